"""Megatron backend on CPU: HF <-> Megatron mapping, torch_dist conversion, TP=2 over gloo,
TP1 -> TP2 resume, and the MegatronTrainer learning. Needs the `megatron` extra."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from miles_core.config import AlgorithmConfig, TinyModelConfig, TrainingConfig
from miles_core.tiny import build_tiny_model
from miles_core.training.megatron import mapping
from miles_core.training.megatron.model import model_shape
from tests.support import max_abs_diff, random_samples, with_tokenizer

LOGIT_TOL = 1e-4
RESUME_TOL = 1e-5


# ---- fixtures: a tied Qwen3, an untied Qwen2 with qkv biases, a tiny Qwen3-MoE ---------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    root = tmp_path_factory.mktemp("megatron")
    qwen3 = build_tiny_model(TinyModelConfig(), root / "qwen3")
    base = json.loads((qwen3 / "config.json").read_text())
    dims = dict(vocab_size=base["vocab_size"], hidden_size=base["hidden_size"], num_hidden_layers=2,
                num_attention_heads=base["num_attention_heads"], num_key_value_heads=base["num_key_value_heads"],
                max_position_embeddings=256, pad_token_id=base["pad_token_id"], eos_token_id=base["eos_token_id"])
    torch.manual_seed(1)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(intermediate_size=base["intermediate_size"], tie_word_embeddings=False,
                                         **dims))
    with torch.no_grad():  # non-zero biases, so the qkv-bias interleave is exercised
        for name, param in qwen2.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)
    torch.manual_seed(2)
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, norm_topk_prob=True, head_dim=24,
                                             tie_word_embeddings=False, **dims))
    torch.manual_seed(3)
    llama = LlamaForCausalLM(LlamaConfig(intermediate_size=128, tie_word_embeddings=False, rope_theta=5e5, **dims))
    return {"qwen3": qwen3, "qwen2": with_tokenizer(qwen2, qwen3, root / "qwen2"),
            "moe": with_tokenizer(moe, qwen3, root / "moe"), "llama": with_tokenizer(llama, qwen3, root / "llama"),
            "root": root}


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _disk_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


TRAINING = dict(lr=3e-3, micro_batch_size=4, num_threads=1)


# ---- pure mapping -------------------------------------------------------------------------------------
def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import GPT2Config

    from miles_core.training.megatron.convert import convert_hf_to_torch_dist

    gpt2 = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, architectures=["GPT2LMHeadModel"])
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported architectures: .*LlamaForCausalLM.*"
                                         "Qwen2ForCausalLM.*Qwen3ForCausalLM.*Qwen3MoeForCausalLM"):
        convert_hf_to_torch_dist(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "moe", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_bit_exact(models, name, tp):
    from transformers import AutoConfig

    hf = _disk_weights(models[name])
    shape = model_shape(AutoConfig.from_pretrained(models[name]), tp)
    ranks = [mapping.hf_to_megatron_rank(hf, shape, tp, r) for r in range(tp)]
    if tp == 2:  # each rank really holds half of the column/row-parallel tensors
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert ranks[0][qkv].shape[0] * 2 == mapping.hf_to_megatron(hf, shape)[qkv].shape[0]
        assert ranks[0]["embedding.word_embeddings.weight"].shape[0] == shape.padded_vocab // 2
    back = mapping.megatron_ranks_to_hf(ranks, shape)
    expected = {k: v for k, v in hf.items() if not (shape.tied and k == "lm_head.weight")}
    assert set(back) == set(expected)
    for key, value in expected.items():
        assert torch.equal(back[key], value), key


def test_fc1_shard_holds_gate_and_up_of_the_rank():
    full = torch.arange(8.0).repeat_interleave(2).view(8, 2)  # gate rows 0-3, up rows 4-7
    assert torch.equal(mapping.shard("decoder.layers.0.mlp.linear_fc1.weight", full, 2, 1)[:, 0],
                       torch.tensor([2.0, 3.0, 6.0, 7.0]))


# ---- TP=1 in this process ---------------------------------------------------------------------------
def test_tp1_logits_match_hf_and_torch_dist_round_trip(models, tmp_path):
    from miles_core.training.megatron.convert import convert_hf_to_torch_dist, export_torch_dist_to_hf, verify_manifest
    from miles_core.training.megatron.model import build_gpt_model, forward_logits, init_parallel, shutdown_parallel

    created = init_parallel(1)
    try:
        tokens = torch.randint(0, 87, (3, 13), generator=torch.Generator().manual_seed(0))
        for name in ("qwen3", "qwen2", "moe", "llama"):
            hf = _hf(models[name])
            shape = model_shape(hf.config, 1)
            model = build_gpt_model(hf.config, 1).eval()
            model.load_state_dict(mapping.hf_to_megatron_rank(_disk_weights(models[name]), shape, 1, 0), strict=False)
            with torch.no_grad():
                diff = (hf(input_ids=tokens).logits - forward_logits(model, tokens)[..., :shape.vocab_size]).abs().max()
            assert diff <= LOGIT_TOL, (name, float(diff))
    finally:
        shutdown_parallel(created)
    manifest = convert_hf_to_torch_dist(models["qwen2"], tmp_path / "ckpt", tp=1)
    assert verify_manifest(tmp_path / "ckpt")["key"] == manifest["key"] and manifest["layout"] == {"tp": 1, "pp": 1}
    again = convert_hf_to_torch_dist(models["qwen2"], tmp_path / "ckpt", tp=1)
    assert again["created_unix"] == manifest["created_unix"]
    out = export_torch_dist_to_hf(tmp_path / "ckpt", models["qwen2"], tmp_path / "hf")
    original, exported = _disk_weights(models["qwen2"]), _disk_weights(out)
    assert set(original) == set(exported) and all(torch.equal(original[k], exported[k]) for k in original)


def test_rope_from_cos_sin_computed_once_equals_megatrons_own(models):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from miles_core.training.megatron.model import build_gpt_model, init_parallel, shutdown_parallel
    from miles_core.training.megatron.rope import apply_rope

    created = init_parallel(1)
    try:
        model = build_gpt_model(_hf(models["llama"]).config, 1)  # rope_theta 5e5
        head_dim = model.config.kv_channels
        cos_sin = model.rotary_pos_emb(13)  # what each layer now gets
        angles = RotaryEmbedding.forward(model.rotary_pos_emb, 13)  # what megatron would hand it
        assert cos_sin.shape == (13, 1, 1, 2 * head_dim) and angles.shape == (13, 1, 1, head_dim)
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.randn(13, 2, model.config.num_attention_heads, head_dim,
                            generator=torch.Generator().manual_seed(0)).to(dtype)
            assert torch.equal(apply_rope(t, cos_sin, model.config), apply_rotary_pos_emb(t, angles, config=model.config))
            assert torch.equal(apply_rope(t, angles, config=model.config), apply_rotary_pos_emb(t, angles, config=model.config))
    finally:
        shutdown_parallel(created)


def test_chunked_vocab_parallel_logprobs_match_log_softmax():
    from miles_core.training.logprobs import token_logprobs
    from miles_core.training.megatron.model import init_parallel, shutdown_parallel

    created = init_parallel(1)
    try:
        logits = torch.randn(3, 17, 128, generator=torch.Generator().manual_seed(0)).requires_grad_()
        targets = torch.randint(0, 100, (3, 17), generator=torch.Generator().manual_seed(1))
        weights = torch.rand(2, 3, 17, generator=torch.Generator().manual_seed(2))
        reference = torch.log_softmax(logits[..., :100] / 0.7, dim=-1)  # 28 padded vocab rows
        ref_logp = reference.gather(-1, targets[..., None]).squeeze(-1)
        ref_entropy = -(reference.exp() * reference).sum(-1)
        ((ref_logp * weights[0]).sum() + (ref_entropy * weights[1]).sum()).backward()
        expected = logits.grad.clone()
        for chunk in (None, 5):  # one piece / several
            logits.grad = None
            logp, entropy = token_logprobs(logits, targets, 0.7, 100, with_entropy=True, chunk_tokens=chunk)
            assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)
            ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
            assert torch.allclose(logits.grad, expected, atol=1e-6) and logits.grad[..., 100:].abs().max() == 0
    finally:
        shutdown_parallel(created)


def test_trainer_learns_and_saves_at_tp1(models):
    from miles_core.training.fsdp import FSDPTrainer
    from miles_core.training.megatron.trainer import MegatronTrainer
    from miles_core.weight_sync.layout import weights_sha256

    training, algorithm = TrainingConfig(**TRAINING), AlgorithmConfig(name="grpo", entropy_coef=0.01)
    trainer = MegatronTrainer(str(models["qwen3"]), training, algorithm, group_size=2)
    try:
        fsdp = FSDPTrainer(str(models["qwen3"]), training, algorithm, group_size=2)
        assert trainer.weights_sha256() == weights_sha256(fsdp.hf_state_dict())
        fsdp.close()
        samples = random_samples()
        losses = [trainer.sft_step(samples) for _ in range(4)]
        assert losses[-1] < losses[0] - 0.3, losses
        before_rl = trainer.weights_sha256()
        metrics = trainer.train_step(samples)
        assert all(v == v for v in metrics.values()) and "train/entropy" in metrics
        assert metrics["train/grad_norm"] > 0 and trainer.weights_sha256() != before_rl  # the RL step updated
        ckpt = models["root"] / "tp1_state"
        trainer.save_state(ckpt, {"step": 5})
        fixed = random_samples(seed=7)
        reference = {"logp_before": trainer.compute_logprobs(fixed), "sft_loss": trainer.sft_step(fixed),
                     "logp_after": trainer.compute_logprobs(fixed)}
        (models["root"] / "tp1_reference.json").write_text(json.dumps(reference))
    finally:
        trainer.close()


def test_trainer_ppo_critic_trains_and_checkpoints(models, tmp_path):
    from miles_core.training.megatron.trainer import MegatronTrainer

    algorithm = AlgorithmConfig(name="ppo", kl_in_reward_coef=0.01)
    trainer = MegatronTrainer(str(models["qwen3"]), TrainingConfig(**TRAINING), algorithm, group_size=2)
    try:
        initial_head = trainer.value_head.score.weight.detach().clone()
        metrics = [trainer.train_step(random_samples()) for _ in range(2)]
        assert all("train/value_loss" in m and m["train/value_loss"] == m["train/value_loss"] for m in metrics)
        head = trainer.value_head.score.weight.detach().clone()
        assert not torch.equal(head, initial_head)  # the critic trained
        trainer.save_state(tmp_path, {"k": 1})
        trainer.value_head.score.weight.data.zero_()
        assert trainer.load_state(tmp_path) == {"k": 1}
        assert torch.equal(trainer.value_head.score.weight, head)
    finally:
        trainer.close()


SHIFT = 0.3  # the behaviour policy (rollout) gave each sampled token e^-0.3 of the trainer's probability


def _step_with_shifted_rollout(trainer_cls, model_dir: Path, algorithm: AlgorithmConfig) -> dict[str, float]:
    trainer = trainer_cls(str(model_dir), TrainingConfig(**TRAINING), algorithm, group_size=2)
    try:
        samples = random_samples()
        for sample, logp in zip(samples, trainer.compute_logprobs(samples)):
            sample.rollout_logprobs = [x - SHIFT for x in logp]
        return trainer.train_step(samples)
    finally:
        trainer.close()


def test_old_logprob_source_and_corrections_mean_the_same_on_both_backends(models):
    from miles_core.training.fsdp import FSDPTrainer
    from miles_core.training.megatron.trainer import MegatronTrainer

    variants = {"rollout": AlgorithmConfig(old_logprob_source="rollout"),
                "tis": AlgorithmConfig(correction={"kind": "tis", "high": 2.0}),
                "none": AlgorithmConfig(correction={"kind": "none"}, entropy_coef=0.0)}
    runs = {(backend, name): _step_with_shifted_rollout(cls, models["qwen3"], algorithm)
            for backend, cls in (("fsdp", FSDPTrainer), ("megatron", MegatronTrainer))
            for name, algorithm in variants.items()}
    for backend in ("fsdp", "megatron"):
        rollout, tis, none = (runs[backend, name] for name in ("rollout", "tis", "none"))
        for m in (rollout, tis, none):  # mismatch metrics compare the trainer's own log-probs with the rollout's
            assert m["mismatch/logprob_abs_diff"] == pytest.approx(SHIFT, abs=1e-4), backend
        # rollout: the ratio is pi_theta / pi_rollout = e^0.3 at the first update (beyond 1 + 0.28: clipped)
        assert rollout["train/ppo_kl"] == pytest.approx(-SHIFT, abs=1e-4), backend
        assert rollout["train/clip_frac"] > 0
        # trainer + TIS: ratio 1, every token weighted by clamp(e^0.3, 0, 2), i.e. not a no-op
        assert tis["train/ppo_kl"] == pytest.approx(0.0, abs=1e-5) and tis["train/clip_frac"] == 0
        assert tis["train/pg_loss"] == pytest.approx(none["train/pg_loss"] * torch.e ** SHIFT, rel=1e-4), backend
        assert abs(none["train/pg_loss"]) > 1e-3
    for name in variants:
        for key in ("train/pg_loss", "train/ppo_kl", "train/clip_frac", "mismatch/logprob_abs_diff"):
            assert runs["fsdp", name][key] == pytest.approx(runs["megatron", name][key], abs=1e-4), (name, key)


# ---- TP=2: two gloo processes --------------------------------------------------------------------------
def _tp2_rank(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from miles_core.training.megatron import mapping as mp
    from miles_core.training.megatron.convert import convert_hf_to_torch_dist
    from miles_core.training.megatron.model import build_gpt_model, forward_logits, init_parallel
    from miles_core.training.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    init_parallel(2)
    result: dict = {"logit_diff": {}}
    tokens = torch.randint(0, 87, (3, 13), generator=torch.Generator().manual_seed(0))
    for name in ("qwen3", "qwen2"):
        hf = _hf(Path(paths[name]))
        shape = model_shape(hf.config, 2)
        model = build_gpt_model(hf.config, 2).eval()
        model.load_state_dict(mp.hf_to_megatron_rank(_disk_weights(Path(paths[name])), shape, 2, rank), strict=False)
        with torch.no_grad():
            full = tensor_parallel.gather_from_tensor_model_parallel_region(forward_logits(model, tokens))
            result["logit_diff"][name] = float((hf(input_ids=tokens).logits - full[..., :shape.vocab_size]).abs().max())
        shards = [None, None]
        dist.all_gather_object(shards, {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")})
        back, disk = mp.megatron_ranks_to_hf(shards, shape), _disk_weights(Path(paths[name]))
        disk.pop("lm_head.weight", None) if shape.tied else None
        result[f"{name}_shards_exact"] = (set(back) == set(disk)
                                          and all(torch.equal(back[k], v) for k, v in disk.items()))
    convert_hf_to_torch_dist(paths["qwen2"], paths["tp2_ckpt"], tp=2)
    trainer = MegatronTrainer(paths["qwen3"], TrainingConfig(**TRAINING),
                              AlgorithmConfig(name="grpo", entropy_coef=0.01), group_size=2, megatron={"tp": 2})
    extra = trainer.load_state(paths["tp1_state"])
    fixed = random_samples(seed=7)
    result.update(extra=extra, logp_before=trainer.compute_logprobs(fixed), sft_loss=trainer.sft_step(fixed),
                  logp_after=trainer.compute_logprobs(fixed), step=trainer.step)
    return result


def test_tp2_logits_shards_conversion_and_tp1_resume(models):
    from miles_core.training.megatron.convert import export_torch_dist_to_hf
    from miles_core.training.megatron.launch import run_spawned

    if not (models["root"] / "tp1_reference.json").is_file():
        pytest.skip("needs test_trainer_learns_and_saves_at_tp1 (the TP=1 checkpoint)")
    paths = {k: str(v) for k, v in models.items()}
    paths |= {"tp1_state": str(models["root"] / "tp1_state"), "tp2_ckpt": str(models["root"] / "tp2_ckpt")}
    result = run_spawned(_tp2_rank, 2, paths)
    assert all(d <= LOGIT_TOL for d in result["logit_diff"].values()), result["logit_diff"]
    assert result["qwen3_shards_exact"] and result["qwen2_shards_exact"]
    # torch_dist saved by two TP ranks, re-assembled at TP=1: bit-exact HF weights
    out = export_torch_dist_to_hf(paths["tp2_ckpt"], None, models["root"] / "tp2_export")
    original, exported = _disk_weights(models["qwen2"]), _disk_weights(out)
    assert set(original) == set(exported) and all(torch.equal(original[k], exported[k]) for k in original)
    # TP=1 checkpoint resumed at TP=2: same log-probs, same loss, same update (optimizer moments)
    reference = json.loads((models["root"] / "tp1_reference.json").read_text())
    assert result["extra"] == {"step": 5} and result["step"] == 6
    assert max_abs_diff(result["logp_before"], reference["logp_before"]) <= RESUME_TOL
    assert abs(result["sft_loss"] - reference["sft_loss"]) <= RESUME_TOL
    assert max_abs_diff(result["logp_after"], reference["logp_after"]) <= RESUME_TOL


# ---- two gloo processes vs one: EP=2 (each rank half of the experts, dense weights data-parallel)
# and dense DP=2 (each rank a full replica) -------------------------------------------------------------
# 8 rows in micro-batches of 3: three micro-batches over two ranks, so rank 1 runs a filler one.
EP_TRAINING = dict(lr=3e-3, micro_batch_size=3, num_threads=1)
EP_TOL = 1e-5


def _grpo_trainer(path: str, ep: int):
    from miles_core.training.megatron.trainer import MegatronTrainer

    return MegatronTrainer(path, TrainingConfig(**EP_TRAINING), AlgorithmConfig(name="grpo", entropy_coef=0.01),
                           group_size=2, megatron={"ep": ep})


def _one_step_run(trainer, state_dir: str) -> dict:
    """What the two-rank tests compare: weights and log-probs before and after one GRPO step."""
    def weights() -> dict[str, torch.Tensor]:  # copies: on CPU the tensors may share the parameters' storage
        return {k: v.clone() for k, v in trainer.hf_state_dict().items()}

    out = {"initial": weights(), "logp_before": trainer.compute_logprobs(random_samples())}
    out["metrics"] = trainer.train_step(random_samples())
    out |= {"final": weights(), "logp_after": trainer.compute_logprobs(random_samples())}
    trainer.save_state(state_dir, {"step": 1})
    return out


def _two_rank(rank: int, world_size: int, paths: dict[str, str], ep: int) -> dict:
    torch.set_num_threads(1)
    trainer = _grpo_trainer(paths["model"], ep=ep)
    try:
        local = {mapping.local_expert_index(n) for n in trainer.model.state_dict()} - {None}
        result = {"local_experts": sorted(local), "dp": trainer.dp, **_one_step_run(trainer, paths["two_state"])}
        trainer.load_state(paths["one_state"])  # written by one rank
        result["resumed_logp"] = trainer.compute_logprobs(random_samples(seed=7))
        return result
    finally:
        trainer.close()


@pytest.mark.parametrize("model,ep", [("moe", 2), ("qwen3", 1)], ids=["ep2-moe", "dp2-dense"])
def test_two_ranks_train_like_one_and_checkpoint_across_sizes(models, tmp_path, model, ep):
    from miles_core.training.megatron.launch import run_spawned

    paths = {"model": str(models[model]), "one_state": str(tmp_path / "one"), "two_state": str(tmp_path / "two")}
    trainer = _grpo_trainer(paths["model"], ep=1)
    try:
        reference = _one_step_run(trainer, paths["one_state"])
        reference["resumed_logp"] = trainer.compute_logprobs(random_samples(seed=7))
    finally:
        trainer.close()
    result = run_spawned(_two_rank, 2, paths, ep)
    assert result["dp"] == 2  # the dense weights are data-parallel either way
    assert result["local_experts"] == ([0, 1] if ep == 2 else [])  # 4 experts: two per rank
    # weight sync / export gathers every rank's experts: bit-exact HF weights
    assert set(result["initial"]) == set(reference["initial"])
    assert all(torch.equal(result["initial"][k], v) for k, v in reference["initial"].items())
    assert max_abs_diff(result["logp_before"], reference["logp_before"]) <= EP_TOL
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert result["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-4, abs=1e-6), key
    # the same update: expert gradients from both ranks' tokens, dense gradients summed over dp
    assert all(torch.allclose(result["final"][k], v, atol=EP_TOL) for k, v in reference["final"].items())
    assert not torch.equal(result["final"]["model.embed_tokens.weight"], result["initial"]["model.embed_tokens.weight"])
    assert max_abs_diff(result["logp_after"], reference["logp_after"]) <= EP_TOL
    # a one-rank checkpoint resumes on two, and a two-rank checkpoint on one
    assert max_abs_diff(result["resumed_logp"], reference["resumed_logp"]) <= EP_TOL
    trainer = _grpo_trainer(paths["model"], ep=1)
    try:
        assert trainer.load_state(paths["two_state"]) == {"step": 1}
        restored = trainer.hf_state_dict()
        assert all(torch.equal(restored[k], v) for k, v in result["final"].items())
    finally:
        trainer.close()
