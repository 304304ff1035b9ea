"""training.fsdp: activation checkpointing gives the same step as without it; bf16 compute keeps
fp32 master weights and trains close to fp32."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from miles_core.config import AlgorithmConfig, TrainingConfig
from miles_core.training.fsdp import FSDPTrainer
from tests.support import max_abs_diff, random_samples


def _two_steps(model_dir, **fsdp) -> tuple[list[dict], dict[str, torch.Tensor], list[list[float]]]:
    training = TrainingConfig(num_threads=1, lr=1e-2, micro_batch_size=4, fsdp=fsdp)
    trainer = FSDPTrainer(str(model_dir), training, AlgorithmConfig(name="grpo", entropy_coef=0.01), group_size=2)
    assert trainer.model.is_gradient_checkpointing == training.fsdp.activation_checkpointing
    try:
        metrics = [trainer.train_step(random_samples(8, seed=s)) for s in (1, 2)]
        return metrics, trainer.hf_state_dict(to_cpu=True), trainer.compute_logprobs(random_samples(4, seed=3))
    finally:
        trainer.close()


def test_activation_checkpointing_recomputes_the_same_gradients(tiny_model_dir):
    plain, checkpointed = _two_steps(tiny_model_dir), _two_steps(tiny_model_dir, activation_checkpointing=True)
    for before, after in zip(plain[0], checkpointed[0]):
        assert after["train/grad_norm"] == pytest.approx(before["train/grad_norm"], abs=1e-6)
        assert after["train/loss"] == pytest.approx(before["train/loss"], abs=1e-6)
    assert max(float((plain[1][k] - checkpointed[1][k]).abs().max()) for k in plain[1]) <= 1e-6


def test_bf16_compute_keeps_fp32_master_weights_and_trains_close_to_fp32(tiny_model_dir):
    fp32, bf16 = _two_steps(tiny_model_dir), _two_steps(tiny_model_dir, compute_dtype="bfloat16")
    assert all(t.dtype == torch.float32 for t in bf16[1].values())  # master weights (and exports) stay fp32
    initial = load_file(f"{tiny_model_dir}/model.safetensors")
    updates = [torch.cat([(weights[k] - initial[k]).flatten() for k in initial if k in weights])
               for weights in (fp32[1], bf16[1])]
    assert not torch.equal(*updates)  # bf16 rounding changes the step...
    assert float(torch.nn.functional.cosine_similarity(*updates, dim=0)) > 0.9  # ...not its direction (0.99 seen)
    assert bf16[0][0]["train/loss"] == pytest.approx(fp32[0][0]["train/loss"], abs=5e-2)
    assert 0 < max_abs_diff(bf16[2], fp32[2]) < 0.5  # log-probs carry bf16 rounding (0.12 seen)
