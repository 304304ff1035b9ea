"""MoE routing replay (R3) on CPU: the embedded engine records HF's expert choices, the rollout
manager turns SGLang's base64 buffer into Sample.routed_experts, and the Megatron trainer's
routers use exactly those experts (forward and, with recompute, backward), which brings its
log-probs back to the engine's when its own routing would differ."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from miles_core.config import (
    AlgorithmConfig,
    ConfigError,
    RolloutConfig,
    TinyModelConfig,
    TrainingConfig,
    build_config,
)
from miles_core.tiny import build_tiny_model
from miles_core.types import Prompt, Sample
from tests.support import with_tokenizer

NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 8, 2
# The trainer's router weights get noise of ROUTER_NOISE x their std: it flips the top-k of some
# tokens (~1 in 7 here), as engine/trainer numerics do near ties, and changes every gate weight a
# little. Experts of std EXPERT_STD differ enough that a flipped choice shows in the log-probs.
ROUTER_NOISE = 0.1
EXPERT_STD = 0.2


def build_moe_dirs(root: Path, hidden_size: int = 96, moe_intermediate_size: int = 32) -> dict[str, Path]:
    """A dense tiny model (for its tokenizer) and a tiny Qwen3-MoE of NUM_EXPERTS experts, top-k
    TOP_K, 4 attention heads of hidden_size / 4."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense = build_tiny_model(TinyModelConfig(hidden_size=hidden_size), root / "dense")
    base = json.loads((dense / "config.json").read_text())
    torch.manual_seed(7)
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=base["vocab_size"], hidden_size=base["hidden_size"], num_hidden_layers=NUM_LAYERS,
        num_attention_heads=base["num_attention_heads"], num_key_value_heads=base["num_key_value_heads"],
        max_position_embeddings=256, pad_token_id=base["pad_token_id"], eos_token_id=base["eos_token_id"],
        intermediate_size=128, moe_intermediate_size=moe_intermediate_size, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, head_dim=hidden_size // base["num_attention_heads"], tie_word_embeddings=False))
    with torch.no_grad():  # experts that differ a lot, so that choosing another one shows
        for layer in moe.model.layers:
            for param in layer.mlp.experts.parameters():
                param.normal_(std=EXPERT_STD)
    return {"dense": dense, "moe": with_tokenizer(moe, dense, root / "moe")}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return build_moe_dirs(tmp_path_factory.mktemp("r3"))


@pytest.fixture(scope="module")
def engine(dirs):
    from miles_core.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine(str(dirs["moe"]), num_threads=1)


def _prompts(n: int = 4) -> list[Prompt]:
    rng = random.Random(0)
    return [Prompt(index=i, messages="", label="", input_ids=[rng.randrange(5, 80) for _ in range(4 + i)])
            for i in range(n)]


def _hf_topk(model, ids: list[int]) -> np.ndarray:
    """Independent reference: HF's own router logits of the unpadded sequence -> softmax, top-k."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    per_layer = [torch.topk(torch.softmax(logits.float(), -1), TOP_K, dim=-1).indices for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).numpy()  # [len(ids), layers, top_k]


def test_embedded_engine_records_hf_top_k(engine):
    prompts = _prompts()
    outs = engine.generate([p.input_ids for p in prompts], {"temperature": 1.0, "max_new_tokens": 6,
                                                            "ignore_eos": True}, seed=0, return_routed_experts=True)
    for prompt, out in zip(prompts, outs):
        ids = prompt.input_ids + out["output_ids"]
        routed = np.asarray(out["meta_info"]["routed_experts"])
        assert routed.shape == (len(ids) - 1, NUM_LAYERS, TOP_K)
        expected = _hf_topk(engine.model, ids)[:-1]
        assert np.array_equal(np.sort(routed, -1), np.sort(expected, -1))
    plain = engine.generate([prompts[0].input_ids], {"max_new_tokens": 2}, seed=0)
    assert "routed_experts" not in plain[0]["meta_info"]  # only when asked


class _RecordingEngines:
    num_healthy = 1

    def __init__(self, engine):
        self.engine, self.extras = engine, []

    def generate(self, input_ids, sampling_params, **extra):
        self.extras.append(extra)
        return self.engine.generate(input_ids, sampling_params,
                                    return_routed_experts=extra.get("return_routed_experts", False))


def test_manager_asks_only_when_enabled_and_decodes_sglang_base64(engine):
    from miles_core.rollout.manager import RolloutManager, decode_routed_experts

    rollout = RolloutConfig(num_samples_per_prompt=1, max_new_tokens=3)
    engines = _RecordingEngines(engine)
    plain = RolloutManager(engines, rollout, "exact_match").generate(_prompts(2), 0)
    assert all(s.routed_experts is None for s in plain)
    samples = RolloutManager(engines, rollout, "exact_match", return_routed_experts=True).generate(_prompts(2), 0)
    assert engines.extras == [{}, {"return_routed_experts": True}]
    for s in samples:
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, NUM_LAYERS, TOP_K)
        flat = base64.b64encode(s.routed_experts.astype(np.int32).tobytes()).decode()  # SGLang's wire format
        decoded = decode_routed_experts(flat, len(s.routed_experts))
        assert decoded.shape == (len(s.routed_experts), NUM_LAYERS * TOP_K)
        assert np.array_equal(decoded.reshape(s.routed_experts.shape), s.routed_experts)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_routed_experts(flat, len(s.routed_experts) + 1)


def test_http_engine_returns_routed_experts_through_the_router(dirs, engine):
    """The flag travels as SGLang's top-level request field, through Router and HTTP."""
    from miles_core.engines.embedded.http_server import serve
    from miles_core.engines.sglang.client import SGLangClient
    from miles_core.rollout.router import Router

    prompt = _prompts(1)[0].input_ids
    params = {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 0}
    with serve(dirs["moe"], num_threads=1) as handle:
        router = Router([SGLangClient(handle.url, timeout_seconds=30, retries=0)])
        asked = router.generate([prompt], params, return_logprob=True, return_routed_experts=True)[0]
        plain = router.generate([prompt], params, return_logprob=True)[0]
    routed = np.asarray(asked["meta_info"]["routed_experts"])
    assert routed.shape == (len(prompt) + len(asked["output_ids"]) - 1, NUM_LAYERS, TOP_K)
    assert np.array_equal(routed, engine.routed_experts([prompt + asked["output_ids"]])[0].numpy())
    assert "routed_experts" not in plain["meta_info"]


# ---- the trainer ---------------------------------------------------------------------------------
def _rollout_samples(engine, as_sglang: bool) -> list[Sample]:
    from miles_core.rollout.manager import RolloutManager

    prompts = _prompts()
    outs = engine.generate([p.input_ids for p in prompts], {"temperature": 1.0, "max_new_tokens": 6,
                                                            "ignore_eos": True}, seed=1, return_routed_experts=True)
    if as_sglang:  # the flat base64 buffer: the trainer must reshape it itself
        for out in outs:
            routed = np.asarray(out["meta_info"]["routed_experts"], dtype=np.int32)
            out["meta_info"]["routed_experts"] = base64.b64encode(routed.tobytes()).decode()
    manager = RolloutManager(None, RolloutConfig(), "exact_match", return_routed_experts=True)
    return [manager._sample(p, out) for p, out in zip(prompts, outs)]


def _trainer(model_dir: Path, recompute: bool = False, lr: float = 1e-3):
    from miles_core.training.megatron.trainer import MegatronTrainer

    training = TrainingConfig(backend="megatron", lr=lr, micro_batch_size=4, num_threads=1,
                              megatron={"routing_replay": True, "recompute_activations": recompute})
    return MegatronTrainer(str(model_dir), training, AlgorithmConfig(name="grpo"), temperature=1.0, group_size=2)


def _perturb_routers(trainer, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if name.endswith("mlp.router.weight"):
                param.add_(torch.randn(param.shape, generator=generator).to(param.device) * ROUTER_NOISE * param.std())


class _RoutingMaps:
    """The experts megatron's routers actually used: each TopKRouter's routing_map output."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.maps: list[torch.Tensor] = []
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.hooks = [r.register_forward_hook(lambda _m, _i, out: self.maps.append(out[1].detach().clone()))
                      for r in routers]

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def _expected_maps(samples: list[Sample]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Engine experts as megatron routing maps [s * b, experts] per layer (sequence-major),
    and which of those rows are real (non-final, non-pad) tokens."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    maps = torch.zeros(NUM_LAYERS, width, len(samples), NUM_EXPERTS, dtype=torch.bool)
    real = torch.zeros(width, len(samples), dtype=torch.bool)
    for b, s in enumerate(samples):
        ids = torch.from_numpy(np.asarray(s.routed_experts).reshape(-1, NUM_LAYERS, TOP_K).astype(np.int64))
        for layer in range(NUM_LAYERS):
            maps[layer, : len(ids), b].scatter_(-1, ids[:, layer], True)
        real[: len(ids), b] = True
    return [m.reshape(-1, NUM_EXPERTS) for m in maps], real.reshape(-1)


def _max_diff(trainer_logp: list[list[float]], samples: list[Sample]) -> float:
    return max(float(np.max(np.abs(np.asarray(t) - np.asarray(s.rollout_logprobs))))
               for t, s in zip(trainer_logp, samples))


def replay_then_free(trainer, samples: list[Sample]) -> dict:
    """With the trainer's routers perturbed: max |trainer - rollout| log-prob and the experts each
    router used, first replaying the rollout's experts, then routing freely (the same trainer)."""
    _perturb_routers(trainer)
    recorder = _RoutingMaps(trainer.model)
    replayed = _max_diff(trainer.compute_logprobs(samples), samples)
    used_with_replay = [m.cpu() for m in recorder.maps]
    trainer.opts.routing_replay = False
    recorder.maps.clear()
    free = _max_diff(trainer.compute_logprobs(samples), samples)
    used_free = [m.cpu() for m in recorder.maps]
    recorder.close()
    return {"replayed": replayed, "free": free, "used_with_replay": used_with_replay, "used_free": used_free}


def check_replay(out: dict, expected: list[torch.Tensor], real: torch.Tensor) -> None:
    """replay_then_free's result: replay used exactly the rollout's experts on every real token,
    free routing differed somewhere, and replay brought the log-probs closer."""
    for layer in range(NUM_LAYERS):
        assert torch.equal(out["used_with_replay"][layer][real], expected[layer][real]), layer
    assert any((out["used_free"][layer][real] != expected[layer][real]).any() for layer in range(NUM_LAYERS))
    assert out["replayed"] < out["free"]


def test_megatron_forward_replays_the_engine_experts(dirs, engine):
    samples = _rollout_samples(engine, as_sglang=True)
    expected, real = _expected_maps(samples)
    trainer = _trainer(dirs["moe"])
    try:
        assert len(trainer.model.router_replays) == NUM_LAYERS
        unperturbed = _max_diff(trainer.compute_logprobs(samples), samples)
        out = replay_then_free(trainer, samples)
    finally:
        trainer.close()
    replayed, free, used_with_replay, used_free = (out[k] for k in ("replayed", "free", "used_with_replay", "used_free"))
    print(f"max |train - rollout| logprob: unperturbed {unperturbed:.2e}, perturbed routers with replay "
          f"{replayed:.2e}, without replay {free:.2e}")
    assert len(used_with_replay) == len(used_free) == NUM_LAYERS  # one forward of micro-batch 4 per layer
    for layer in range(NUM_LAYERS):
        assert torch.equal(used_with_replay[layer][real], expected[layer][real]), layer
    flipped = sum(int((used_free[layer][real] != expected[layer][real]).any(-1).sum()) for layer in range(NUM_LAYERS))
    print(f"tokens x layers routed differently without replay: {flipped} of {int(real.sum()) * NUM_LAYERS}")
    assert flipped > 0  # the perturbation really changes free routing
    assert unperturbed < 1e-4
    assert replayed < free / 5  # measured: ~9e-3 with replay, ~1e-1 without


def test_recompute_replays_the_same_experts_in_backward(dirs, engine):
    """With activation recompute the backward re-runs every router; it must replay the forward's
    experts (REPLAY_BACKWARD), so one update equals the update without recompute."""
    samples = _rollout_samples(engine, as_sglang=False)
    for i, s in enumerate(samples):  # one better sample per group of 2: non-zero advantages
        s.reward = float(i % 2)
    expected, real = _expected_maps(samples)
    results = {}
    for recompute in (False, True):
        trainer = _trainer(dirs["moe"], recompute=recompute)
        try:
            _perturb_routers(trainer)
            recorder = _RoutingMaps(trainer.model)
            metrics = trainer.train_step(samples)
            recorder.close()
            results[recompute] = (metrics, {k: v.clone() for k, v in trainer.model.state_dict().items()
                                            if not k.endswith("_extra_state")}, recorder.maps)
        finally:
            trainer.close()
    (plain_metrics, plain_weights, _), (re_metrics, re_weights, re_maps) = results[False], results[True]
    # score pass + update forward + the backward's recompute, each once per layer
    assert len(re_maps) == 3 * NUM_LAYERS
    # the backward recomputes the layers in reverse order, so match each map to some layer
    assert all(any(torch.equal(used[real], e[real]) for e in expected) for used in re_maps)
    weight_diff = max(float((plain_weights[k] - re_weights[k]).abs().max()) for k in plain_weights)
    print(f"grad norm without / with recompute: {plain_metrics['train/grad_norm']:.6f} / "
          f"{re_metrics['train/grad_norm']:.6f}; max weight difference after the update {weight_diff:.1e}")
    assert plain_metrics["train/grad_norm"] > 1e-3  # a real update, not a zero gradient
    assert abs(plain_metrics["train/grad_norm"] - re_metrics["train/grad_norm"]) < 1e-5
    assert weight_diff < 1e-6


# ---- validation ------------------------------------------------------------------------------------
def test_routing_replay_on_a_dense_model_is_refused_with_the_fix(dirs):
    with pytest.raises(ConfigError, match="needs an MoE model.*routing_replay=false"):
        build_config({}, ["training.backend=megatron", "training.megatron.routing_replay=true"])
    with pytest.raises(ConfigError, match="training.backend=megatron"):
        build_config({"model": {"source": str(dirs["moe"])}}, ["training.megatron.routing_replay=true"])
    sglang = {"model": {"source": str(dirs["moe"])}, "training": {"backend": "megatron", "megatron": {
        "routing_replay": True}}, "rollout": {"engine": "sglang", "gpus_per_engine": 1, "weight_transport": "disk"}}
    with pytest.raises(ConfigError, match="enable_return_routed_experts=true"):
        build_config(sglang)
    sglang["rollout"]["engine"] = {"kind": "sglang", "server_args": {"enable_return_routed_experts": True}}
    assert build_config(sglang).routing_replay
    with pytest.raises(ValueError, match="needs an MoE model .*without experts.*routing_replay=false"):
        _trainer(dirs["dense"])


def test_a_sample_without_routed_experts_is_refused(dirs, engine):
    samples = _rollout_samples(engine, as_sglang=False)
    samples[1].routed_experts = None
    trainer = _trainer(dirs["moe"])
    try:
        with pytest.raises(ValueError, match="enable_return_routed_experts=true"):
            trainer.compute_logprobs(samples)
    finally:
        trainer.close()
