"""The FSDP2 trainer on a lent GPU (not run in CI): the class a Ray trainer actor runs, on CUDA,
against the same trainer on the CPU; and DP=2 against DP=1 when two GPUs are lent.

    python -m pytest tests/gpu/test_fsdp_gpu.py

Ray is stubbed when missing (the GPU machine has none); nothing here calls it.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
try:
    import ray  # noqa: F401
except ImportError:
    sys.modules["ray"] = types.ModuleType("ray")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
TOL = 1e-4  # fp32 on both devices, TF32 off: kernel order only


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from miles_core.config import TinyModelConfig
    from miles_core.tiny import build_tiny_model

    return str(build_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny") / "model"))


def _step(model_dir: str, dp: int = 1, compile_layers: bool = False) -> dict:
    from miles_core.config import AlgorithmConfig, TrainingConfig
    from miles_core.training.fsdp import FSDPTrainer
    from tests.support import random_samples

    torch.backends.cuda.matmul.allow_tf32 = False
    trainer = FSDPTrainer(model_dir, TrainingConfig(micro_batch_size=4, data_parallel_size=dp,
                                                         compile_decoder_layers=compile_layers),
                          AlgorithmConfig(name="grpo", entropy_coef=0.01), group_size=2)
    try:
        compiled = sum(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in trainer.model.model.layers)
        metrics = trainer.train_step(random_samples(10, seed=1))
        weights = trainer.hf_state_dict(to_cpu=True)
        return {"device": str(next(trainer.model.parameters()).device), "metrics": metrics, "compiled": compiled,
                "logp": trainer.compute_logprobs(random_samples(6, seed=2)), "weights": weights}
    finally:
        trainer.close()


def _dp_rank(rank: int, world_size: int, model_dir: str) -> dict:
    return _step(model_dir, dp=world_size)


def test_trainer_runs_on_the_gpu_like_on_the_cpu(model_dir, monkeypatch):
    from miles_core.training.megatron.launch import run_spawned
    from tests.support import max_abs_diff

    gpu = _step(model_dir)
    assert gpu["device"].startswith("cuda")
    with monkeypatch.context() as env:  # the spawned process sees no GPU: it trains on the CPU, gloo
        env.setenv("CUDA_VISIBLE_DEVICES", "")
        cpu = run_spawned(_dp_rank, 1, model_dir)
    assert cpu["device"] == "cpu"
    assert gpu["metrics"]["train/loss"] == pytest.approx(cpu["metrics"]["train/loss"], abs=TOL)
    assert gpu["metrics"]["train/grad_norm"] == pytest.approx(cpu["metrics"]["train/grad_norm"], abs=TOL)
    assert max_abs_diff(gpu["logp"], cpu["logp"]) <= TOL


def test_compiled_decoder_layers_train_like_eager_ones(model_dir):
    from tests.support import max_abs_diff

    eager, compiled = _step(model_dir), _step(model_dir, compile_layers=True)
    assert compiled["compiled"] > 0 and eager["compiled"] == 0
    assert compiled["metrics"]["train/loss"] == pytest.approx(eager["metrics"]["train/loss"], abs=TOL)
    assert compiled["metrics"]["train/grad_norm"] == pytest.approx(eager["metrics"]["train/grad_norm"], abs=TOL)
    assert max_abs_diff(compiled["logp"], eager["logp"]) <= TOL


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_dp2_on_two_gpus_trains_like_dp1(model_dir):
    from miles_core.training.megatron.launch import run_spawned
    from tests.support import max_abs_diff

    one, two = _step(model_dir), run_spawned(_dp_rank, 2, model_dir)
    assert two["metrics"]["train/grad_norm"] == pytest.approx(one["metrics"]["train/grad_norm"], abs=TOL)
    assert max_abs_diff(two["logp"], one["logp"]) <= TOL
