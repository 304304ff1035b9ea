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


def test_engine_releases_its_kv_cache_and_rebuilds_it_on_the_next_call(tiny_model_dir):
    from miles_core.rollout.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=True)
    params = {"max_new_tokens": 4, "temperature": 0.0}
    before = engine.generate([[5, 6]], params)[0]["output_ids"]
    assert engine.slots.cache is not None
    engine.release_memory(["kv_cache"])
    assert engine.slots.cache is None and not engine.released_weights  # weights untouched
    engine.resume_memory(["kv_cache"])
    assert engine.generate([[5, 6]], params)[0]["output_ids"] == before and engine.slots.cache is not None
