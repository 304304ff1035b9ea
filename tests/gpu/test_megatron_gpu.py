"""Megatron backend on a lent GPU (not run in CI): logits vs HF, the trainer learning and
resuming, and a small run of bench/megatron_mfu.py.

    python tests/gpu/test_megatron_gpu.py          # or: python -m pytest tests/gpu/test_megatron_gpu.py

Works with megatron-core 0.16 (Python 3.11) and 0.19 (Python 3.12, the lent GPU's wheel).
Ray is stubbed when missing (the GPU machine has none).
"""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
try:
    import ray  # noqa: F401
except ImportError:  # miles_core.weight_sync.transports imports ray at module level; nothing here calls it
    sys.modules["ray"] = types.ModuleType("ray")

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _samples(n: int = 16, seed: int = 0):
    from miles_core.types import Sample

    rng = random.Random(seed)
    return [Sample(prompt_index=i // 2, prompt_ids=[rng.randrange(5, 80) for _ in range(8)],
                   response_ids=[rng.randrange(5, 80) for _ in range(6)], label="", reward=float(i % 2),
                   rollout_logprobs=[-2.0] * 6) for i in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from miles_core.config import TinyModelConfig
    from miles_core.tiny import build_tiny_model

    return build_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("gpu") / "tiny")


def test_logits_match_hf_on_gpu(tiny):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_core.training.megatron import mapping
    from miles_core.training.megatron.model import (
        build_gpt_model,
        forward_logits,
        init_parallel,
        model_shape,
        shutdown_parallel,
    )

    created = init_parallel(1)
    try:
        hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
        shape = model_shape(hf.config, 1)
        model = build_gpt_model(hf.config, 1).eval()
        weights = {k: v.cuda() for k, v in load_file(str(tiny / "model.safetensors")).items()}
        model.load_state_dict(mapping.hf_to_megatron_rank(weights, shape, 1, 0), strict=False)
        tokens = torch.randint(0, shape.vocab_size, (4, 64), device="cuda")
        with torch.no_grad():
            diff = (hf(input_ids=tokens).logits - forward_logits(model, tokens)[..., :shape.vocab_size]).abs().max()
        assert float(diff) <= 1e-3
    finally:
        shutdown_parallel(created)


def test_trainer_learns_and_resumes_on_gpu(tiny, tmp_path):
    from miles_core.config import AlgorithmConfig, TrainingConfig
    from miles_core.training.megatron.trainer import MegatronTrainer

    training = TrainingConfig(lr=3e-3, micro_batch_size=8)
    trainer = MegatronTrainer(str(tiny), training, AlgorithmConfig(name="grpo"), group_size=2)
    try:
        samples = _samples()
        losses = [trainer.sft_step(samples) for _ in range(5)]
        assert losses[-1] < losses[0], losses
        metrics = trainer.train_step(samples)
        assert all(v == v for v in metrics.values())
        trainer.save_state(tmp_path / "ckpt", {"step": 6})
        expected = trainer.compute_logprobs(samples)
        trainer.sft_step(samples)  # move away, then come back
        assert trainer.load_state(tmp_path / "ckpt") == {"step": 6}
        got = trainer.compute_logprobs(samples)
        assert max(abs(a - b) for ra, rb in zip(expected, got) for a, b in zip(ra, rb)) <= 1e-5
        trainer.export_hf(tmp_path / "hf")
        assert (tmp_path / "hf" / "model.safetensors").is_file()
    finally:
        trainer.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_logprobs_match_eager_on_gpu(dtype, monkeypatch):
    """The torch.compile'd fused log-prob (CUDA), in one piece and in chunks, against the eager
    chunked path: values and grads."""
    from miles_core.training import logprobs
    from miles_core.training.logprobs import token_logprobs

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(3, 37, 640, device="cuda", generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, 600, (3, 37), device="cuda", generator=gen)
    weights = torch.rand(2, 3, 37, device="cuda", generator=gen)
    monkeypatch.setattr(logprobs, "_COMPILED", {})  # a failed compile elsewhere must not make this test eager
    out = {}
    for mode in ("0", "1", "1 chunked"):  # chunked: the rows of a micro-batch over 2^31 logits go in pieces
        monkeypatch.setenv("MILES_COMPILE_LOGPROBS", mode[0])
        monkeypatch.setattr(logprobs, "COMPILED_CHUNK_ELEMENTS", 640 * 16 if "chunked" in mode else 1 << 31)
        logits.grad = None
        logp, entropy = token_logprobs(logits, targets, 0.8, 600, with_entropy=True,
                                       chunk_tokens=16 if mode == "0" else None)
        ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        out[mode] = (logp.detach(), entropy.detach(), logits.grad.float().clone())
    for mode in ("1", "1 chunked"):
        for a, b in zip(out["0"], out[mode]):
            assert torch.allclose(a, b, atol=2e-3 if dtype == torch.bfloat16 else 1e-5, rtol=1e-3), (a - b).abs().max()
        assert out[mode][2][..., 600:].abs().max() == 0
    assert set(logprobs._COMPILED) == {"stats", "grad_into"}  # compiled, and no fallback to eager


def test_mfu_bench_runs_small():
    sys.path.insert(0, str(REPO / "bench"))
    import megatron_mfu

    summary = megatron_mfu.main(["--layers", "2", "--seq", "512", "--batch", "2", "--steps", "2", "--warmup", "1"])
    assert summary["megatron"]["best"]["tokens_per_s"] > 0 and summary["fsdp2_hf"]["best"]["tokens_per_s"] > 0
    assert summary["logits_max_rel_diff"] < 0.05
    json.dumps(summary)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider", "-o", "addopts="]))


def test_routing_replay_uses_the_engine_experts_on_gpu(tmp_path_factory):
    """R3 on CUDA (bf16 autocast, nccl, the GPU's megatron-core): Megatron's routers use exactly
    the experts the embedded engine recorded, while free routing with perturbed routers differs."""
    from miles_core.engines.embedded.engine import EmbeddedEngine
    from tests.integration import test_routing_replay as r3

    dirs = r3.build_moe_dirs(tmp_path_factory.mktemp("r3"))
    engine = EmbeddedEngine(str(dirs["moe"]), num_threads=1, slot_decoding=False)
    samples = r3._rollout_samples(engine, as_sglang=True)
    expected, real = r3._expected_maps(samples)
    trainer = r3._trainer(dirs["moe"])
    try:
        out = r3.replay_then_free(trainer, samples)
    finally:
        trainer.close()
    replayed, free = out["replayed"], out["free"]
    print(f"GPU max |train - rollout| logprob with replay {replayed:.3e}, without {free:.3e}")
    r3.check_replay(out, expected, real)
