"""The Megatron trainer group on real Ray (CPU, gloo): TP=2 as two rank actors behind one handle,
a TP=2 run of the training driver that checkpoints, syncs the engines and resumes at TP=1, an
EP=2 MoE run with routing replay, a dense DP=2 run that resumes at DP=1, and a failing rank that
surfaces as an exception instead of a hang."""

from __future__ import annotations

import json
import time

import pytest
import ray
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist
from safetensors.torch import load_file

from miles_core.config import AlgorithmConfig, ConfigError, TrainingConfig, build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver.session import TrainSpec, run_training
from miles_core.driver.trainer_group import kill_trainer, start_trainer_group
from miles_core.training.megatron.trainer import MegatronTrainer
from tests.support import max_abs_diff, random_samples

GROUP_TOL = 1e-4
ON_POLICY_TOL = 1e-4



def _training(tp: int) -> TrainingConfig:
    return TrainingConfig(backend="megatron", megatron={"tensor_parallel_size": tp}, micro_batch_size=4, num_threads=1)


def _group(trainer_type: type, model_dir) -> object:
    args = (str(model_dir), _training(2), AlgorithmConfig(name="grpo"))
    group = start_trainer_group(trainer_type, 2, lambda rank: {}, {"CPU": 1.0}, args, {"group_size": 2})
    ray.get(group.__ray_ready__.remote(), timeout=120)
    return group


def test_tp2_group_logprobs_equal_one_tp1_trainer(ray_local_3cpus, tiny_model_dir):
    samples = random_samples(6, seed=3)
    single = ray.remote(num_cpus=1)(MegatronTrainer).remote(str(tiny_model_dir), _training(1),
                                                           AlgorithmConfig(name="grpo"), group_size=2)
    reference = ray.get(single.compute_logprobs.remote(samples))
    ray.kill(single)
    group = _group(MegatronTrainer, tiny_model_dir)
    try:
        got = ray.get(group.compute_logprobs.remote(samples))
        assert [len(r) for r in got] == [len(s.response_ids) for s in samples]
        assert max_abs_diff(got, reference) <= GROUP_TOL
        # bad input raises on every rank: one exception from the one ref, and the group is gone
        with pytest.raises(AttributeError):
            ray.get(group.compute_logprobs.remote([None]), timeout=60)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group.actors[1].__ray_ready__.remote(), timeout=60)
    finally:
        kill_trainer(group)


class _Rank1Fails(MegatronTrainer):
    def fail_on_rank1(self) -> None:
        if dist.get_rank() == 1:
            raise ValueError("rank 1 refuses")
        dist.barrier()  # rank 0 waits in a collective rank 1 never joins


def test_a_failing_rank_raises_instead_of_hanging(ray_local_3cpus, tiny_model_dir):
    group = _group(_Rank1Fails, tiny_model_dir)
    try:
        started = time.perf_counter()
        with pytest.raises(ValueError, match="rank 1 refuses"):
            ray.get(group.fail_on_rank1.remote(), timeout=60)
        assert time.perf_counter() - started < 30  # not gloo's 30 min collective timeout
    finally:
        kill_trainer(group)


def test_tensor_parallel_is_accepted_pipeline_still_refused():
    cfg = build_config({}, ["training.backend=megatron", "training.megatron.tensor_parallel_size=2"])
    assert cfg.training.world_size == 2
    with pytest.raises(ConfigError, match="pipeline_parallel_size=1"):
        build_config({}, ["training.backend=megatron", "training.megatron.pipeline_parallel_size=2"])


def _spec(tmp_path, model_dir, tp: int, num_steps: int, extra: tuple[str, ...] = ()) -> TrainSpec:
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")
    cfg = build_config({}, ["training.backend=megatron", f"training.megatron.tensor_parallel_size={tp}",
                            f"training.cpus_per_trainer={tp}", f"training.num_steps={num_steps}",
                            "checkpoint.interval_steps=2", "rollout.num_prompts_per_step=4",
                            "rollout.num_samples_per_prompt=4", "rollout.verify_weight_sync=true",
                            "training.num_threads=1", "training.micro_batch_size=8",
                            # a gradient even when every reward of the random tiny model is equal
                            "algorithm.entropy_coef=0.01", *extra])
    return TrainSpec(config=cfg, model_dir=str(model_dir), train_path=str(train),
                     run_dir=str(tmp_path / "run"))


def test_tp2_run_checkpoints_syncs_engines_and_resumes_at_tp1(ray_local_3cpus, tmp_path, tiny_model_dir):
    broadcast = ("rollout.weight_transport=broadcast",)
    first = run_training(_spec(tmp_path, tiny_model_dir, tp=2, num_steps=3, extra=broadcast))
    assert first.steps == 3 and first.resumed_from_step is None
    # sync loop: each step's rollouts come from the weights rank 0 gathered over TP and broadcast
    # (verify_weight_sync compared their sha256 with the trainer's)
    diffs = [h["rollout/train_logprob_abs_diff"] for h in first.history]
    assert max(diffs) <= ON_POLICY_TOL, diffs
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000003"], checkpoints
    exported = load_file(f"{first.hf_export_dir}/model.safetensors")
    initial = load_file(f"{tiny_model_dir}/model.safetensors")
    assert any(not torch.equal(v, initial[k]) for k, v in exported.items())  # the weights moved

    # the TP=2 torch_dist checkpoint, loaded by one TP=1 trainer: the same weights...
    same = run_training(_spec(tmp_path, tiny_model_dir, tp=1, num_steps=3, extra=broadcast))
    assert same.resumed_from_step == 3 and same.steps == 3 and same.history == []
    again = load_file(f"{same.hf_export_dir}/model.safetensors")
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in exported)
    # ...and training continues from there
    more = run_training(_spec(tmp_path, tiny_model_dir, tp=1, num_steps=4, extra=broadcast))
    assert more.resumed_from_step == 3 and [h["step"] for h in more.history] == [4]
    assert more.history[0]["rollout/train_logprob_abs_diff"] <= ON_POLICY_TOL
    state = json.loads(open(f"{more.final_checkpoint_dir}/trainer_state.json").read())
    assert state["step"] == 4 and state["weight_version"] == 4


def test_ep2_moe_run_with_routing_replay_syncs_engines_on_policy(ray_local_3cpus, tmp_path, tiny_moe_model_dir):
    # each rank holds 2 of the 4 experts; 16 rollouts in micro-batches of 6 deal 2 + 1 (+ a filler)
    spec = _spec(tmp_path, tiny_moe_model_dir, tp=1, num_steps=2,
                 extra=(f"model.source={tiny_moe_model_dir}", "training.megatron.expert_parallel_size=2",
                        "training.cpus_per_trainer=2",
                        "training.micro_batch_size=6", "training.megatron.routing_replay=true",
                        "rollout.weight_transport=shared_memory", "placement.layout=colocated"))
    result = run_training(spec)
    assert result.steps == 2
    # the shared buffer held both ranks' experts: the engines' sha256 matched the trainer's
    # (verify_weight_sync), and the next rollouts' log-probs are the trainer's own
    diffs = [h["rollout/train_logprob_abs_diff"] for h in result.history]
    assert max(diffs) <= ON_POLICY_TOL, diffs
    exported = load_file(f"{result.hf_export_dir}/model.safetensors")
    initial = load_file(f"{tiny_moe_model_dir}/model.safetensors")
    experts = [k for k in initial if ".mlp.experts." in k]
    assert experts and all(exported[k].shape == initial[k].shape for k in experts)
    assert any(not torch.equal(exported[k], initial[k]) for k in experts)  # experts of both ranks trained


def test_dense_dp2_run_syncs_engines_on_policy_and_resumes_at_dp1(ray_local_3cpus, tmp_path, tiny_model_dir):
    # two full replicas of the dense model, each training half of every batch's micro-batches
    dp2 = run_training(_spec(tmp_path, tiny_model_dir, tp=1, num_steps=2,
                             extra=("training.data_parallel_size=2", "training.cpus_per_trainer=2")))
    assert dp2.steps == 2
    diffs = [h["rollout/train_logprob_abs_diff"] for h in dp2.history]
    assert max(diffs) <= ON_POLICY_TOL, diffs
    more = run_training(_spec(tmp_path, tiny_model_dir, tp=1, num_steps=3))
    assert more.resumed_from_step == 2 and [h["step"] for h in more.history] == [3]
    assert more.history[0]["rollout/train_logprob_abs_diff"] <= ON_POLICY_TOL
