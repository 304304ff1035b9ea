"""rollout/tokens_wasted: generated tokens never trained on, for every loop (issue 42's bench metric)."""

from __future__ import annotations

import time

import pytest

from miles_core.config import build_config
from miles_core.driver.loop import tokens_wasted
from miles_core.driver.schedules import FullyAsyncSchedule, RolloutBatch
from miles_core.metrics import ASYNC_DROPPED_TOKENS, PARTIAL_TOKENS_THROWN_AWAY, TOKENS_WASTED
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


def test_partial_rollouts_report_what_their_pool_threw_away_and_sync_reports_zero():
    assert tokens_wasted({}) == {TOKENS_WASTED: 0.0}  # sync, one-step-off: every batch trains
    partial = {ASYNC_DROPPED_TOKENS: 0.0, PARTIAL_TOKENS_THROWN_AWAY: 0.0}
    assert tokens_wasted(partial) == {TOKENS_WASTED: 0.0}
    assert tokens_wasted(partial | {PARTIAL_TOKENS_THROWN_AWAY: 8.0}) == {TOKENS_WASTED: 8.0}
