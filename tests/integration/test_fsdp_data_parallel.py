"""FSDP2 data parallelism on real Ray (CPU, gloo): two rank actors sharding one model train like
one rank on the same global batch, checkpoint for any DP size, and run the training driver
(rollouts, weight sync to the engines, checkpoints) end to end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from miles_core.config import AlgorithmConfig, TrainingConfig, build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver.session import TrainSpec, run_training
from miles_core.driver.trainer_group import kill_trainer, start_trainer_group
from miles_core.training.fsdp import FSDPTrainer
from miles_core.weight_sync.shared import SHM_DIR
from tests.support import max_abs_diff, random_samples

# DP=2 sums the same per-token terms as DP=1 in another order: float32 rounding only.
DP_TOL = 1e-5
ON_POLICY_TOL = 1e-4



def _trainer(model_dir, dp: int, algorithm: AlgorithmConfig):
    # micro-batches of 4 over 10 samples: rank 0 gets two, rank 1 one plus a masked filler
    training = TrainingConfig(micro_batch_size=4, num_threads=1, lr=1e-2, data_parallel_size=dp)
    args = (str(model_dir), training, algorithm)
    if dp == 1:
        return ray.remote(num_cpus=1)(FSDPTrainer).remote(*args, group_size=2)
    group = start_trainer_group(FSDPTrainer, dp, lambda rank: {}, {"CPU": 1.0}, args, {"group_size": 2})
    ray.get(group.__ray_ready__.remote(), timeout=120)
    return group


def _weights(trainer) -> dict[str, torch.Tensor]:
    return ray.get(trainer.hf_state_dict.remote(to_cpu=True))


@pytest.mark.parametrize("algorithm", [AlgorithmConfig(name="grpo", entropy_coef=0.01),
                                       AlgorithmConfig(name="ppo", kl_loss_coef=0.1)], ids=["grpo", "ppo+kl"])
def test_dp2_trains_like_dp1_on_the_same_global_batch(ray_local_3cpus, tiny_model_dir, tmp_path, algorithm):
    batches = [random_samples(10, seed=s) for s in (1, 2)]
    single, group = _trainer(tiny_model_dir, 1, algorithm), _trainer(tiny_model_dir, 2, algorithm)
    try:
        for samples in batches:  # the second step also checks the optimizer states agree
            one, two = ray.get([single.train_step.remote(samples), group.train_step.remote(samples)])
            assert two.keys() == one.keys() and "train/grad_norm" in one
            for key in one:  # losses, grad norm, clip and KL statistics, mismatch metrics
                assert two[key] == pytest.approx(one[key], abs=DP_TOL), key
        expected, got = _weights(single), _weights(group)
        initial = load_file(f"{tiny_model_dir}/model.safetensors")
        assert any(not torch.equal(v, initial[k]) for k, v in expected.items())  # the weights moved
        assert got.keys() == expected.keys()
        assert max(float((got[k] - expected[k]).abs().max()) for k in expected) <= DP_TOL

        # a checkpoint written at DP=2 resumes at DP=1: same weights, same next step
        ray.get(group.save_state.remote(str(tmp_path / "ckpt"), {"step": 2}))
        kill_trainer(single)  # its CPU goes to the resumed trainer
        resumed = _trainer(tiny_model_dir, 1, algorithm)
        assert ray.get(resumed.load_state.remote(str(tmp_path / "ckpt")), timeout=120) == {"step": 2}
        samples = random_samples(10, seed=3)
        after_two, after_resume = ray.get([group.train_step.remote(samples), resumed.train_step.remote(samples)])
        assert after_resume["train/loss"] == pytest.approx(after_two["train/loss"], abs=DP_TOL)
        probe = random_samples(6, seed=4)
        assert max_abs_diff(ray.get(resumed.compute_logprobs.remote(probe)),
                            ray.get(group.compute_logprobs.remote(probe))) <= DP_TOL
        kill_trainer(resumed)
    finally:
        kill_trainer(single)
        kill_trainer(group)


def shm_buffers() -> set[Path]:
    return set(SHM_DIR.glob("miles-weights-*"))


def left_behind(before: set[Path], settle_seconds: float = 10.0) -> set[Path]:
    """Weight buffers made since `before` that are still there after settle_seconds. A run beside
    this one (another pytest process) has its own, each removed as soon as its engines map it."""
    deadline = time.monotonic() + settle_seconds
    while (left := shm_buffers() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_dp2_run_syncs_engines_checkpoints_and_resumes_at_dp1(ray_local_3cpus, tmp_path, tiny_model_dir):
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")

    def spec(dp: int, num_steps: int, transport: str) -> TrainSpec:
        cfg = build_config({}, [f"training.data_parallel_size={dp}", f"training.cpus_per_trainer={dp}",
                                f"training.num_steps={num_steps}", "checkpoint.interval_steps=2",
                                "rollout.num_prompts_per_step=4", "rollout.num_samples_per_prompt=4",
                                "rollout.verify_weight_sync=true", f"rollout.weight_transport.kind={transport}",
                                "training.num_threads=1", "training.micro_batch_size=6", "placement.layout=colocated",
                                "algorithm.entropy_coef=0.01"])
        return TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train), run_dir=str(tmp_path / "run"))

    before = shm_buffers()
    first = run_training(spec(dp=2, num_steps=3, transport="shared_memory"))
    assert first.steps == 3
    assert not left_behind(before)  # unlinked once the engine mapped it
    # each step's rollouts come from the weights rank 0 shared (then broadcast) for the group (their
    # sha256 matched the trainer's), so the trainer and the engines score the same policy
    assert max(h["rollout/train_logprob_abs_diff"] for h in first.history) <= ON_POLICY_TOL
    exported = load_file(f"{first.hf_export_dir}/model.safetensors")
    initial = load_file(f"{tiny_model_dir}/model.safetensors")
    assert any(not torch.equal(v, initial[k]) for k, v in exported.items())
    more = run_training(spec(dp=1, num_steps=4, transport="broadcast"))
    assert more.resumed_from_step == 3 and [h["step"] for h in more.history] == [4]
    assert more.history[0]["rollout/train_logprob_abs_diff"] <= ON_POLICY_TOL
    state = json.loads(open(f"{more.final_checkpoint_dir}/trainer_state.json").read())
    assert state["step"] == 4
