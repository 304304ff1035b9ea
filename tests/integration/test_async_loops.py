"""Rollout schedules on real Ray: ordering, staleness bounds and version monotonicity."""

import pytest

from miles_core.config import build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver.session import TrainSpec, run_training
from miles_core.metrics import ASYNC_DROPPED_TOKENS, PARTIAL_TOKENS_THROWN_AWAY, TOKENS_UNUSED_AT_END, TOKENS_WASTED

NUM_STEPS = 6


def spec(tmp_path, tiny_model_dir, *overrides):
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")
    cfg = build_config({}, [f"training.num_steps={NUM_STEPS}", "checkpoint.interval_steps=3",
                            "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4",
                            "training.num_threads=1", "rollout.cpus_per_engine=0.5", *overrides])
    return TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train),
                     run_dir=str(tmp_path / "run"))


def test_one_step_off_is_exactly_one_version_behind(ray_local, tmp_path, tiny_model_dir):
    result = run_training(spec(tmp_path, tiny_model_dir, "rollout.loop=one_step_off", "algorithm.correction.kind=tis"))
    # Step k+1's batch was generated with the weights before step k's update, i.e. while step k
    # trained: a sync loop gives [0, 1, 2, ...] and fails this.
    versions = [h["rollout/weight_version"] for h in result.history]
    assert versions == [0.0] + [float(k) for k in range(NUM_STEPS - 1)]


def test_fully_async_respects_the_staleness_bound(ray_local, tmp_path, tiny_model_dir):
    result = run_training(spec(tmp_path, tiny_model_dir, "rollout.loop=fully_async", "rollout.loop.max_weight_staleness=1",
                               "rollout.loop.buffer_batches=2", "algorithm.old_logprob_source=rollout"))
    staleness = [h["async/staleness"] for h in result.history]
    versions = [h["rollout/weight_version"] for h in result.history]
    assert result.steps == NUM_STEPS and max(staleness) <= 1
    # The producer ran ahead of the trainer (a batch from older weights was trained on): a sync
    # loop, or a producer that waits for each update, would give staleness 0 everywhere.
    assert sum(s == 1 for s in staleness) >= NUM_STEPS // 2, staleness
    assert versions == sorted(versions)  # never trains on an older batch after a newer one
    assert all(h["rollout/weight_version"] == h["step"] - 1 - s for h, s in zip(result.history, staleness))
    assert all(h[TOKENS_WASTED] == h[ASYNC_DROPPED_TOKENS] for h in result.history)  # dropped batches' tokens
    # The batch made ahead for a step that never comes is reported once, on the last step.
    assert [TOKENS_UNUSED_AT_END in h for h in result.history] == [False] * (NUM_STEPS - 1) + [True]
    assert result.history[-1][TOKENS_UNUSED_AT_END] >= 0


def test_async_without_correction_is_rejected():
    with pytest.raises(ValueError, match="off-policy"):
        build_config({}, ["rollout.loop=one_step_off"])


def test_fully_async_with_partial_rollouts_trains_every_step(ray_local, tmp_path, tiny_model_dir):
    result = run_training(spec(tmp_path, tiny_model_dir, "rollout.loop=fully_async", "rollout.partial.enabled=true",
                               "algorithm.correction.kind=tis", "rollout.max_new_tokens=96"))
    assert result.steps == NUM_STEPS
    for h in result.history:  # per-token versions reach the batch and the trainer's metrics
        assert 0.0 <= h["rollout/mixed_version_sample_frac"] <= 1.0
        assert h["train/mixed_version_sample_frac"] == h["rollout/mixed_version_sample_frac"]
        assert sum(v for k, v in h.items() if k.startswith("rollout/tokens_behind_")) > 0
        assert h[TOKENS_WASTED] == h[PARTIAL_TOKENS_THROWN_AWAY] + h[ASYNC_DROPPED_TOKENS]
    print("mixed-version share, response length per step:",
          [(h["rollout/mixed_version_sample_frac"], h["rollout/response_len_mean"]) for h in result.history])


def test_a_resumed_partial_run_trains_its_checkpoints_unconsumed_batch_first(ray_local, tmp_path, tiny_model_dir):
    from miles_core.rollout.partial_state import read_pool_state

    partial = ("rollout.loop=fully_async", "rollout.partial.enabled=true", "algorithm.correction.kind=tis",
               "rollout.max_new_tokens=96")
    first = run_training(spec(tmp_path, tiny_model_dir, *partial, "training.num_steps=3"))
    pool = read_pool_state(first.final_checkpoint_dir, group_size=4)  # taken inside the step-3 weight update
    assert first.steps == 3 and pool.rounds >= 3
    resumed = run_training(spec(tmp_path, tiny_model_dir, *partial, "training.num_steps=5"))
    assert resumed.resumed_from_step == 3 and [h["step"] for h in resumed.history] == [4, 5]
    if pool.batches:  # made before the crash: trained first, as the uninterrupted run would have
        kept = pool.batches[0].metrics
        assert resumed.history[0]["rollout/reward_mean"] == kept["rollout/reward_mean"]
        assert resumed.history[0]["time/rollout_seconds"] == pool.batches[0].seconds
    print("restored:", len(pool.pending), "cut groups,", len(pool.done), "done groups,", len(pool.batches), "batches")
