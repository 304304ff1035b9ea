"""training.lora: config validation, adapter-only training on FSDP2, adapter-only weight sync to
the embedded engine, checkpoints and the HF export (merged + PEFT adapter folder)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from miles_core.config import build_config
from miles_core.config.base import ConfigError
from miles_core.engines.embedded.engine import EmbeddedEngine
from miles_core.training.fsdp import FSDPTrainer
from miles_core.types import Sample
from miles_core.weight_sync.lora import payload_bytes
from tests.support import max_abs_diff, random_samples

LORA = ["training.lora.rank=4", "training.lora.alpha=8", "training.num_threads=1", "training.lr=1e-2"]


def _whole(state):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


@pytest.fixture
def lora_trainer(tiny_model_dir):
    cfg = build_config({}, LORA)
    trainer = FSDPTrainer(str(tiny_model_dir), cfg.training, cfg.algorithm, group_size=2)
    yield trainer
    trainer.close()


# ---- config -----------------------------------------------------------------------------------

def test_lora_section_presence_enables_it_and_bad_values_say_how_to_fix():
    import yaml

    assert build_config(yaml.safe_load("training:\n  lora: {}\n"), []).training.lora_enabled
    # null is off: a dumped config without LoRA must validate back to the same config
    assert not build_config(yaml.safe_load("training:\n  lora:\n"), []).training.lora_enabled
    assert not build_config({}, []).training.lora_enabled
    assert not build_config({}, ["training.lora.enabled=false"]).training.lora_enabled
    from miles_core.config import RunConfig

    for cfg in (build_config({}, []), build_config({}, ["training.lora.rank=4"])):
        assert RunConfig.model_validate(cfg.model_dump()) == cfg  # resolved configs round-trip
    with pytest.raises(ConfigError, match="fsdp2 backend only.*set training.backend=fsdp2"):
        build_config({}, ["training.backend=megatron", "training.lora.rank=4"])
    build_config({}, ["training.backend=megatron", "training.lora.enabled=false"])  # off: no refusal
    with pytest.raises(ConfigError, match="training.lora.rank"):
        build_config({}, ["training.lora.rank=0"])
    with pytest.raises(ConfigError, match="not paths or lm_head"):
        build_config({}, ["training.lora.target_modules=[model.layers.0.q_proj]"])


# ---- training ---------------------------------------------------------------------------------

def test_a_step_changes_only_adapters_and_the_base_stays_bit_identical(lora_trainer):
    trainer = lora_trainer
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in trainer.model.named_parameters() if n in trainable}
    before = _whole(trainer.model.state_dict())
    for seed in (1, 2):  # the first step moves only B (A's gradient is B^T(...) = 0); the second both
        trainer.train_step(random_samples(4, seed=seed))
    after = _whole(trainer.model.state_dict())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == trainable
    assert all(len(s) == 0 for p, s in trainer.optimizer.state.items() if id(p) not in in_optimizer)


def test_adapter_sync_moves_only_adapter_bytes_and_log_probs_agree(lora_trainer, tiny_model_dir):
    trainer = lora_trainer
    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=False)
    full = engine.update_weights_from_tensors(trainer.hf_state_dict(to_cpu=True), "0")
    samples = random_samples(4, seed=3)
    for step in (1, 2, 3):  # re-merged from the unmerged base each time, not on top of the last merge
        trainer.train_step(random_samples(4, seed=step))
        result = engine.update_weights_from_tensors(trainer.adapter_state_dict(), str(step))
        assert result["success"], result
    assert result["received_bytes"] * 4 < full["received_bytes"], (result, full)
    assert engine.weights_sha256() == trainer.weights_sha256()  # merged the same way, bit for bit
    engine_lp = []
    for s in samples:
        engine_lp.append(_score(engine, s))
    assert max_abs_diff(engine_lp, trainer.compute_logprobs(samples)) < 1e-4
    # a full update afterwards replaces the base the adapters merge into
    engine.update_weights_from_tensors(trainer.hf_state_dict(to_cpu=True), "4")
    assert not engine.adapters.base


def _score(engine, sample: Sample) -> list[float]:
    """The engine's log-probs of the sample's response tokens given its prompt (a forward pass)."""
    tokens = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=tokens).logits.float()
    logprobs = torch.log_softmax(logits[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
    return logprobs[len(sample.prompt_ids) - 1:].tolist()


def test_checkpoint_resume_continues_bit_exactly(lora_trainer, tiny_model_dir, tmp_path):
    trainer = lora_trainer
    trainer.train_step(random_samples(4, seed=1))
    trainer.save_state(tmp_path / "ckpt", {"cursor": 7})
    cfg = build_config({}, LORA)
    restored = FSDPTrainer(str(tiny_model_dir), cfg.training, cfg.algorithm, group_size=2)
    try:
        assert restored.load_state(tmp_path / "ckpt") == {"cursor": 7}
        for seed in (2, 3):
            trainer.train_step(random_samples(4, seed=seed))
            restored.train_step(random_samples(4, seed=seed))
        assert restored.weights_sha256() == trainer.weights_sha256()
        assert all(torch.equal(a, b) for a, b in zip(restored.adapter_state_dict().values(),
                                                      trainer.adapter_state_dict().values()))
    finally:
        restored.close()


def test_export_is_the_merged_model_with_the_adapter_in_peft_layout(lora_trainer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer
    trainer.train_step(random_samples(4, seed=1))
    trainer.train_step(random_samples(4, seed=2))
    out = trainer.export_hf(tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert not any("lora" in k for k in load_file(str(out / "model.safetensors")))
    plain = AutoModelForCausalLM.from_pretrained(trainer.model_dir, dtype=torch.float32)
    tokens = torch.tensor([random_samples(1, seed=5)[0].prompt_ids])
    with torch.no_grad():
        base_logits = plain(input_ids=tokens).logits
        got = merged(input_ids=tokens).logits
        expected = PeftModel.from_pretrained(plain, out / "adapter").eval()(input_ids=tokens).logits
    assert (got - expected).abs().max() < 1e-4
    assert (base_logits - expected).abs().max() > 1e-3  # the adapter did something


def test_payload_bytes_counts_what_a_sync_carries():
    assert payload_bytes({"a.lora_A.weight": torch.zeros(4, 8), "a.lora_B.weight": torch.zeros(8, 4)}) == 256


def test_the_registry_tags_say_whether_a_version_is_merged_lora_or_full():
    from miles_core.config import build_config
    from miles_core.tracking.registry import WEIGHTS_TAG, weights_tags

    lora = weights_tags(build_config({}, ["training.lora.rank=8", "training.lora.target_modules=[q_proj,v_proj]"]).training)
    assert lora == {WEIGHTS_TAG: "merged_lora", "lora_adapter_dir": "adapter", "lora_rank": "8", "lora_alpha": "16.0",
                    "lora_target_modules": "q_proj,v_proj"}
    assert weights_tags(build_config({}).training) == {WEIGHTS_TAG: "full"}
    disabled = build_config({}, ["training.lora.rank=8", "training.lora.enabled=false"]).training
    assert weights_tags(disabled) == {WEIGHTS_TAG: "full"}
