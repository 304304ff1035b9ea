"""placement.time_sharing: what the config accepts, and the order in which the loop hands the
device back and forth (checked with recording stubs of the trainer and engines)."""

import pytest

from miles_core.config import ConfigError, build_config


@pytest.mark.parametrize(("overrides", "message"), [
    ([], "set placement.layout=colocated"),
    (["placement.layout=colocated", "rollout.loop=one_step_off", "algorithm.correction.kind=tis"],
     "cannot run rollout.loop=one_step_off: it overlaps generation with training.*set rollout.loop=sync"),
    (["placement.layout=colocated", "rollout.loop=fully_async", "algorithm.correction.kind=tis"],
     "cannot run rollout.loop=fully_async"),
    (["placement.layout=colocated", "training.backend=megatron"], "only the fsdp2 backend implements: set "
                                                                  "training.backend=fsdp2"),
])
def test_time_sharing_is_refused_where_it_cannot_run_and_says_how_to_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, ["placement.time_sharing=true", *overrides])


def test_time_sharing_runs_colocated_and_sync():
    cfg = build_config({}, ["placement.time_sharing=true", "placement.layout=colocated"])
    assert cfg.placement.time_sharing and cfg.rollout.loop.kind == "sync"
