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


def test_a_time_shared_embedded_engine_holds_the_plans_rollout_in_one_round():
    """miles plan's rollout phase counts every sample decoding at once; the KV budget a time-shared
    embedded engine gets (the trainer offloaded: what is free is the GPU less the engine's weights
    and 2 GiB of contexts) holds it, for the Qwen3-4B time-sharing layout at 4096 new tokens on an
    H100 (81559 MiB). An explicit mem_fraction_static is kept; unshared, the default stays."""
    from miles_core.engines.embedded.slot_decoder import kv_budget_bytes
    from miles_core.memory import ModelDims, engine_bytes
    from miles_core.rollout.engine_group import placed_engine

    layout = ["placement.layout=colocated", "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=8",
              "rollout.max_new_tokens=4096", "model.dtype=bfloat16",
              "training.gpus_per_trainer=0.5", "rollout.gpus_per_engine=0.4"]
    cfg = build_config({}, ["placement.time_sharing=true", *layout])
    qwen3_4b = ModelDims(num_layers=36, hidden_size=2560, num_heads=32, num_kv_heads=8, head_dim=128,
                         intermediate_size=9728, vocab_size=151936, tied_embeddings=True)
    weights, kv = engine_bytes(cfg, qwen3_4b)
    total = 81559 * 2**20
    fraction = placed_engine(cfg).mem_fraction_static
    assert kv_budget_bytes(total - weights - 2 * 2**30, total, fraction) >= kv
    assert placed_engine(build_config({}, layout)).mem_fraction_static is None
    explicit = build_config({}, ["placement.time_sharing=true", *layout,
                                 "rollout.engine={kind: embedded, mem_fraction_static: 0.5}"])
    assert placed_engine(explicit).mem_fraction_static == 0.5


def test_engine_releases_its_kv_cache_and_rebuilds_it_on_the_next_call(tiny_model_dir):
    from miles_core.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=True)
    params = {"max_new_tokens": 4, "temperature": 0.0}
    before = engine.generate([[5, 6]], params)[0]["output_ids"]
    assert engine.slots.cache is not None
    engine.release_memory(["kv_cache"])
    assert engine.slots.cache is None and not engine.released_weights  # weights untouched
    engine.resume_memory(["kv_cache"])
    assert engine.generate([[5, 6]], params)[0]["output_ids"] == before and engine.slots.cache is not None


class _Recorder:
    """Stands in for the trainer (its remote calls), the engine group and its clients, and the
    run's weight push, writing each call into one list."""

    def __init__(self):
        self.calls: list[str] = []

    def method(self, name: str, result=None):
        def call(*args, **kwargs):
            self.calls.append(name + (f" {args[0]}" if args and isinstance(args[0], list) else ""))
            return {} if result is None else result
        return call


def test_a_time_shared_step_hands_the_device_over_in_order(monkeypatch):
    """rollout (trainer offloaded) -> release engines -> onload -> train -> resume weights ->
    push -> offload -> resume kv cache, every step."""
    from types import SimpleNamespace

    from miles_core.driver import loop, time_sharing
    from miles_core.driver.run import LoopState
    from miles_core.driver.schedules import RolloutBatch

    rec = _Recorder()
    monkeypatch.setattr(time_sharing, "ray", SimpleNamespace(get=lambda value: value))
    monkeypatch.setattr(loop, "RolloutManager", lambda *a, **k: None)
    monkeypatch.setattr(loop, "make_producer", lambda run, manager: lambda step, version: (
        rec.calls.append("rollout"), RolloutBatch([], {}, version))[1])
    monkeypatch.setattr(loop, "train_on", lambda cfg, trainer, batch: (
        rec.calls.append("train"), {"time/train_seconds": 1.0})[1])
    monkeypatch.setattr(loop, "throughput", lambda batch, seconds: {})
    client = SimpleNamespace(release_memory=rec.method("release"), resume_memory=rec.method("resume"))
    engines = SimpleNamespace(targets=lambda: [(None, "http://e0")], client=lambda url: client,
                              heal=rec.method("heal", []))
    trainer = SimpleNamespace(offload=SimpleNamespace(remote=rec.method("offload")),
                              onload=SimpleNamespace(remote=rec.method("onload")))
    cfg = build_config({}, ["placement.time_sharing=true", "placement.layout=colocated", "training.num_steps=2",
                            "checkpoint.interval_steps=100"])
    run = SimpleNamespace(cfg=cfg, engines=engines, trainer=trainer, tokenizer=None, save=rec.method("save"),
                          evaluator=SimpleNamespace(due=lambda step: False, collect=lambda wait: {}),
                          push_weights=lambda version: (rec.calls.append("push"), {})[1],
                          hooks=SimpleNamespace(on_metrics=lambda *a: None, on_step=lambda *a: None,
                                                before_checkpoint=lambda *a: None, on_checkpoint=lambda *a: None))
    assert loop.run_loop(run, LoopState()).step == 2
    step = ["rollout", "heal", "release ['weights', 'kv_cache']", "onload", "train", "resume ['weights']", "push",
            "offload", "resume ['kv_cache']"]
    assert rec.calls == ["offload", *step, *step, "save"]


def test_plan_shows_each_phase_and_refuses_a_time_shared_layout_that_does_not_fit():
    from typer.testing import CliRunner

    from flows.cli import app
    from miles_core.config import load_config
    from miles_core.memory import GIB, phase_peaks
    from tests.conftest import REPO

    recipe = REPO / "configs" / "qwen3-4b-timeshare.yaml"
    shared = phase_peaks(load_config(recipe))
    unshared = phase_peaks(load_config(recipe, ["placement.time_sharing=false"]))
    assert shared.train < unshared.train and shared.rollout < shared.train < 80 * GIB < unshared.peak
    ok = CliRunner().invoke(app, ["plan", str(recipe), "--skip-preflight"], terminal_width=200)
    assert ok.exit_code == 0, ok.output
    assert all(row in ok.output for row in ("rollout (time-shared)", "train", "sync", "peak per GPU"))
    refused = CliRunner().invoke(app, ["plan", str(recipe), "--skip-preflight", "--gpu-gib", "40"], terminal_width=200)
    assert refused.exit_code == 2
    assert "the train phase needs" in refused.output and "more than the GPU's 40 GiB" in refused.output
