"""rollout/tokens_wasted: generated tokens never trained on, for every loop (issue 42's bench metric)."""

from __future__ import annotations

import time

import pytest

from miles_core.config import build_config
from miles_core.driver.loop import tokens_wasted, unused_at_end
from miles_core.driver.schedules import FullyAsyncSchedule, RolloutBatch, SyncSchedule
from miles_core.metrics import ASYNC_DROPPED_TOKENS, PARTIAL_TOKENS_THROWN_AWAY, TOKENS_UNUSED_AT_END, TOKENS_WASTED
from miles_core.types import Sample


def produce(step: int, version: int) -> RolloutBatch:
    """Batch `step` holds two samples of step + 1 response tokens each."""
    return RolloutBatch([Sample(0, [1], [5] * (step + 1), "") for _ in range(2)], {}, version)


@pytest.mark.parametrize("policy, dropped", [("drop", [1, 2]), ("retry", [1])])
def test_the_fully_async_loop_counts_the_tokens_of_the_stale_batches_it_drops(policy, dropped):
    cfg = build_config({"rollout": {"loop": {"kind": "fully_async", "max_weight_staleness": 1, "buffer_batches": 2,
                                             "stale_policy": policy}}}, ["algorithm.correction.kind=tis"])
    schedule = FullyAsyncSchedule(produce, cfg)
    # Batches 0-2 made at version 0 and checkpointed unconsumed: at this bound the producer itself
    # keeps only one batch ahead, which never goes stale (see the pacing test below).
    schedule.restore([produce(step, 0) for step in range(3)])
    try:
        first = schedule.next(0, 0)
        for _ in range(2):  # two weight updates: batches 1 and 2 are now 2 versions behind
            with schedule.hold_engines():
                pass
        fresh = schedule.next(1, 2)
    finally:
        schedule.close()
    assert first.metrics[ASYNC_DROPPED_TOKENS] == 0 and tokens_wasted(first.metrics)[TOKENS_WASTED] == 0
    expected = sum(2 * (step + 1) for step in dropped)
    assert (fresh.version, fresh.metrics["async/dropped_batches"]) == (2, len(dropped))
    assert fresh.metrics[ASYNC_DROPPED_TOKENS] == expected
    assert tokens_wasted(fresh.metrics) == {TOKENS_WASTED: expected}


def _steps_of_a_slow_trainer(cfg, steps: int, schedule: FullyAsyncSchedule | None = None) -> list[RolloutBatch]:
    """The fully async loop with the instant `produce`: after taking each batch, the trainer waits
    until the producer has made as many batches ahead as it may, and a little more, then updates."""
    schedule = schedule or FullyAsyncSchedule(produce, cfg)
    batches = []
    try:
        for step in range(steps):
            batches.append(schedule.next(step, step))
            deadline = time.monotonic() + 30
            while len(schedule.unconsumed()) < max(cfg.rollout.loop.max_weight_staleness, 1):
                assert time.monotonic() < deadline, "the producer stopped making batches"
                time.sleep(0.01)
            time.sleep(0.05)  # room for a producer that would run further ahead
            with schedule.hold_engines():
                pass
    finally:
        schedule.close()
    return batches


@pytest.mark.parametrize("bound", [1, 2])
def test_a_producer_faster_than_the_trainer_makes_no_batch_that_will_be_stale(bound):
    cfg = build_config({"rollout": {"loop": {"kind": "fully_async", "max_weight_staleness": bound,
                                             "buffer_batches": 3}}}, ["algorithm.correction.kind=tis"])
    batches = _steps_of_a_slow_trainer(cfg, steps=8)
    assert [b.metrics["async/dropped_batches"] for b in batches] == [0.0] * 8
    assert [b.metrics[ASYNC_DROPPED_TOKENS] for b in batches] == [0.0] * 8
    # Each batch is as stale as the bound allows, never more: the producer runs ahead exactly that far.
    assert [b.metrics["async/staleness"] for b in batches] == [float(min(step, bound)) for step in range(8)]


def test_at_staleness_0_the_producer_keeps_one_batch_ahead_and_each_step_drops_at_most_that_one():
    cfg = build_config({"rollout": {"loop": {"kind": "fully_async", "max_weight_staleness": 0,
                                             "buffer_batches": 3}}}, ["algorithm.correction.kind=tis"])
    batches = _steps_of_a_slow_trainer(cfg, steps=4)
    assert [b.metrics["async/staleness"] for b in batches] == [0.0] * 4
    assert [b.metrics["async/dropped_batches"] for b in batches] == [0.0, 1.0, 2.0, 3.0]


def test_partial_rollouts_report_what_their_pool_threw_away_and_sync_reports_zero():
    assert tokens_wasted({}) == {TOKENS_WASTED: 0.0}  # sync, one-step-off: every batch trains
    partial = {ASYNC_DROPPED_TOKENS: 0.0, PARTIAL_TOKENS_THROWN_AWAY: 0.0}
    assert tokens_wasted(partial) == {TOKENS_WASTED: 0.0}
    assert tokens_wasted(partial | {PARTIAL_TOKENS_THROWN_AWAY: 8.0}) == {TOKENS_WASTED: 8.0}


def test_the_batches_made_ahead_when_the_run_ends_are_counted_as_unused():
    cfg = build_config({"rollout": {"loop": {"kind": "fully_async", "max_weight_staleness": 2,
                                             "buffer_batches": 3}}}, ["algorithm.correction.kind=tis"])
    schedule = FullyAsyncSchedule(produce, cfg)
    _steps_of_a_slow_trainer(cfg, steps=3, schedule=schedule)  # trains batches 0-2; 3 and 4 are made ahead
    assert [len(b.samples[0].response_ids) for b in schedule.unconsumed()] == [4, 5]
    assert unused_at_end(schedule, None) == {TOKENS_UNUSED_AT_END: 2 * 4 + 2 * 5}

    class Pool:  # rollout.partial's pool: one group still generating, one finished and not yet batched
        pending = [[Sample(0, [1], [5] * 3, "")]]
        done = [[Sample(0, [1], [5] * 7, ""), Sample(0, [1], [], "")]]

    assert unused_at_end(schedule, Pool()) == {TOKENS_UNUSED_AT_END: 18 + 3 + 7}
    assert unused_at_end(SyncSchedule(produce, cfg), None) == {}  # nothing is generated ahead
