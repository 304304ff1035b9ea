"""Partial rollouts in checkpoints (issue 42): a resumed run continues the cut groups exactly."""

from __future__ import annotations

import itertools
import json
import math
import time
import types
from pathlib import Path

import pytest

from miles_core.config import build_config
from miles_core.data import PromptSource
from miles_core.driver.loop import make_partial_producer, new_pool, producer_state
from miles_core.driver.run import LoopState, TrainingRun
from miles_core.driver.schedules import FullyAsyncSchedule, RolloutBatch
from miles_core.rollout.manager import RolloutManager
from miles_core.rollout.partial_state import POOL_FILE, PartialStateError, read_pool_state, record_batch, write_pool_state
from miles_core.storage import checkpoint as ckpt
from miles_core.types import Prompt

PROMPTS = [Prompt(i, f"p{i}", str(i), [20 + i, 7, i % 5]) for i in range(16)]
LENGTHS = {tuple(p.input_ids): (40 if i % 4 == 0 else 5) for i, p in enumerate(PROMPTS)}
"""Long tail: one prompt in four runs past max_new_tokens (24), the others stop after 5 tokens."""
MAX_NEW_TOKENS, NUM_STEPS, CHECKPOINT_STEP = 24, 8, 2


def policy(context: list[int], version: int, seed: int) -> tuple[int, float]:
    """The stub's sampler: the next token and its log-prob from the context, the weight version
    and the request's sampling_seed (so a resume that replayed other seeds would show)."""
    h = sum((i + 1) * t for i, t in enumerate(context)) + seed % 1009
    return 30 + (h * 31 + version * 17) % 50, -math.log1p(((h * 7 + version) % 97) / 13)


class LongTailEngines:
    """Engines that stop each request after `pause_after` new tokens with finish_reason abort
    (a weight update's pause), else at the prompt's scripted length (stop) or budget (length)."""

    num_healthy = 1

    def __init__(self):
        self.version, self.pause_after = 0, None

    def generate(self, input_ids, sampling_params, **extra):
        return [self._one(list(ids), p["max_new_tokens"], p["sampling_seed"]) for ids, p in zip(input_ids, sampling_params)]

    def _one(self, ids: list[int], budget: int, seed: int) -> dict:
        done = len(ids) - 3  # every prompt is 3 tokens long
        new, logprobs, finish = [], [], "length"
        while len(new) < budget:
            if done + len(new) >= LENGTHS[tuple(ids[:3])]:
                finish = "stop"
                break
            if self.pause_after is not None and len(new) >= self.pause_after:
                finish = "abort"
                break
            token, logprob = policy(ids + new, self.version, seed)
            new.append(token)
            logprobs.append(logprob)
        return {"output_ids": new, "text": "".join(chr(65 + t % 26) for t in new),
                "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, new)],
                              "finish_reason": {"type": finish}, "weight_version": str(self.version)}}


def config(*overrides):
    return build_config({"rollout": {"loop": "fully_async"}},
                        ["rollout.partial.enabled=true", "algorithm.correction.kind=tis", "rollout.num_samples_per_prompt=2",
                         "rollout.num_prompts_per_step=3", f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
                         "rollout.partial.max_staleness_versions=3", *overrides])


class Run:
    """A producer as a (resumed) run builds it: new engines, prompt source, manager and pool,
    and the schedule's buffer, driven by a deterministic script (see `steps`)."""

    def __init__(self, cfg, cursor=None, restored=None):
        self.source = PromptSource(PROMPTS, seed=5)
        if cursor is not None:
            self.source.load_state_dict(cursor)
        self.engines = LongTailEngines()
        manager = RolloutManager(self.engines, cfg.rollout, "exact_match")
        self.pool = new_pool(cfg, manager, restored)
        self.ns = types.SimpleNamespace(cfg=cfg, source=self.source)
        self.produce = make_partial_producer(self.ns, manager, self.pool)
        self.buffer = [record_batch(b) for b in restored.batches] if restored else []

    def round(self, version: int, pause_after: int | None) -> None:
        self.engines.version, self.engines.pause_after = version, pause_after
        batch = self.produce(0, version)
        if batch is not None:
            self.buffer.append(batch)

    def steps(self, first: int, last: int) -> list:
        """The fully async loop, made deterministic: step k waits for a batch (rounds at version k
        run uncut), trains, and while it trains the producer runs rounds while the buffer of 2 has
        room: one to its end, then one that the weight update to version k+1 cuts after 6 new tokens."""
        trained = []
        for step in range(first, last):
            while not self.buffer:
                self.round(step, None)
            trained.append(self.buffer.pop(0))
            for pause_after in (None, 6):
                if len(self.buffer) < 2:
                    self.round(step, pause_after)
        return trained

    def checkpoint(self) -> tuple[dict, dict]:
        """What the loop stores inside the weight update: the cursor and the producer's state."""
        return producer_state(self.ns, types.SimpleNamespace(unconsumed=lambda: list(self.buffer)), self.pool)


def comparable(batch) -> tuple:
    return batch.samples, batch.metrics, batch.version, batch.cursor  # not seconds: measured


def save(checkpoints: Path, step: int, cursor: dict, partial: dict) -> Path:
    """A checkpoint as TrainingRun.save writes it: trainer state, then the pool, then the manifest."""
    def write(staging: Path) -> None:
        (staging / "trainer_state.json").write_text(json.dumps({"step": step, "data": cursor}))
        write_pool_state(staging, partial)
    return ckpt.write_checkpoint(checkpoints, step, "digest", write)


def test_a_resumed_run_continues_the_cut_groups_exactly(tmp_path):
    cfg = config()
    straight = Run(cfg).steps(0, NUM_STEPS)
    interrupted = Run(cfg)
    first = interrupted.steps(0, CHECKPOINT_STEP)
    assert [comparable(b) for b in first] == [comparable(b) for b in straight[:CHECKPOINT_STEP]]
    save(tmp_path / "checkpoints", CHECKPOINT_STEP, *interrupted.checkpoint())
    del interrupted  # the crash

    _, path = ckpt.latest_complete_checkpoint(tmp_path / "checkpoints")
    assert POOL_FILE in json.loads((path / ckpt.MANIFEST).read_text())["files"]  # sealed by the manifest
    pool = read_pool_state(path, group_size=2)
    assert pool.pending and pool.batches, "the test needs cut groups and an untrained batch at the checkpoint"
    cursor = json.loads((path / "trainer_state.json").read_text())["data"]
    resumed = Run(cfg, cursor, pool).steps(CHECKPOINT_STEP, NUM_STEPS)

    assert [comparable(b) for b in resumed] == [comparable(b) for b in straight[CHECKPOINT_STEP:]]
    trained = [s for b in resumed for s in b.samples]
    for cut in (s for g in pool.pending for s in g):  # each cut sample trains, finished after the update
        n = len(cut.response_ids)
        [done] = [s for s in trained if s.prompt_ids == cut.prompt_ids and s.response_ids[:n] == cut.response_ids]
        assert done.token_weight_versions[:n] == cut.token_weight_versions and len(done.response_ids) > n
        assert max(cut.token_weight_versions) < CHECKPOINT_STEP <= done.token_weight_versions[-1]


def test_restored_groups_too_stale_are_dropped_and_counted(tmp_path):
    cfg = config("rollout.partial.max_staleness_versions=1")
    run = Run(cfg)
    run.steps(0, CHECKPOINT_STEP)
    cursor, state = run.checkpoint()
    state |= {"tokens_thrown_away": 50, "groups_thrown_away": 3}  # counted before the checkpoint
    pool = read_pool_state(write_pool_state(tmp_path, state).parent, group_size=2)
    tokens = sum(len(s.response_ids) for g in pool.pending for s in g)
    assert tokens > 0
    resumed = Run(cfg, cursor, pool)
    resumed.buffer = []
    later = resumed.steps(CHECKPOINT_STEP + 5, CHECKPOINT_STEP + 6)[0]  # resumed 5 versions later
    assert later.metrics["rollout/partial_tokens_thrown_away"] == pool.tokens_thrown_away + tokens
    assert later.metrics["rollout/partial_groups_thrown_away"] == pool.groups_thrown_away + len(pool.pending)


def test_the_schedule_hands_out_a_checkpoints_unconsumed_batches_first():
    cfg = build_config({"rollout": {"loop": "fully_async"}}, ["algorithm.correction.kind=tis",
                                                              "rollout.loop.buffer_batches=1",
                                                              "rollout.loop.max_weight_staleness=2"])  # 2 ahead

    def numbered(start: int):
        made = itertools.count(start)
        return lambda step, version: RolloutBatch([], {"n": float(next(made))}, version)

    schedule = FullyAsyncSchedule(numbered(0), cfg)
    try:
        assert schedule.next(0, 0).metrics["n"] == 0.0
        deadline = time.monotonic() + 30
        while not (schedule.buffer.full() and schedule.in_hand) and time.monotonic() < deadline:  # 1 buffered, 1 in hand
            time.sleep(0.01)
        with schedule.hold_engines():
            unconsumed = schedule.unconsumed()
    finally:
        schedule.close()
    assert [b.metrics["n"] for b in unconsumed] == [1.0, 2.0]
    restored = FullyAsyncSchedule(numbered(3), cfg)
    restored.restore(unconsumed)
    try:
        assert [restored.next(k, 1).metrics["n"] for k in range(1, 5)] == [1.0, 2.0, 3.0, 4.0]
    finally:
        restored.close()


# ---- corrupt or foreign files ------------------------------------------------------------------------
def _pool_file(tmp_path) -> dict:
    run = Run(config())
    run.steps(0, CHECKPOINT_STEP)
    return run.checkpoint()[1]


@pytest.mark.parametrize("damage, message", [
    (lambda state: "{\"format\": \"miles.partial_pool\", \"pend", "not a JSON file"),
    (lambda state: state | {"format": "something.else"}, "format"),
    (lambda state: state | {"rounds": "3"}, "rounds"),
    (lambda state: state | {"pending": [state["pending"][0][:1]]}, "has 1 samples, group_size is 2"),
    (lambda state: state | {"pending": [[s | {"rollout_logprobs": s["rollout_logprobs"][:-1]}
                                         for s in state["pending"][0]]]}, "rollout_logprobs has"),
    (lambda state: state | {"pending": [[s | {"exec": "os.system"} for s in state["pending"][0]]]}, "exec"),
])
def test_a_damaged_pool_file_fails_with_a_clear_error(tmp_path, damage, message):
    state = _pool_file(tmp_path)
    damaged = damage(json.loads(json.dumps(state)))
    (tmp_path / POOL_FILE).write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    with pytest.raises(PartialStateError, match=message):
        read_pool_state(tmp_path, group_size=2)


def test_a_pool_file_of_another_group_size_is_refused(tmp_path):
    write_pool_state(tmp_path, _pool_file(tmp_path))
    with pytest.raises(PartialStateError, match="rollout.num_samples_per_prompt=4"):
        read_pool_state(tmp_path, group_size=4)


class FileTrainer:
    """The trainer calls TrainingRun.save/resume make, on files (ray.get is patched to pass values)."""

    def __init__(self):
        self.loaded = []
        self.save_state = types.SimpleNamespace(remote=self._save)
        self.load_state = types.SimpleNamespace(remote=self._load)

    def _save(self, out_dir: str, extra: dict) -> None:
        Path(out_dir, "trainer_state.json").write_text(json.dumps(extra))

    def _load(self, ckpt_dir: str) -> dict:
        self.loaded.append(ckpt_dir)
        return json.loads(Path(ckpt_dir, "trainer_state.json").read_text())


def _run(tmp_path, monkeypatch, cfg) -> TrainingRun:
    monkeypatch.setattr("miles_core.driver.run.ray.get", lambda value: value)
    transport = types.SimpleNamespace(push=lambda trainer, targets, version: {})
    engines = types.SimpleNamespace(targets=list)
    return TrainingRun(cfg, tmp_path, None, PromptSource(PROMPTS, seed=5), None, FileTrainer(), engines, transport,
                       None)


def _saved_at_checkpoint(tmp_path, monkeypatch, cfg) -> dict:
    """A run's checkpoint at CHECKPOINT_STEP with its pool file; returns the saved cursor."""
    run = Run(cfg)
    run.steps(0, CHECKPOINT_STEP)
    cursor, partial = run.checkpoint()
    _run(tmp_path, monkeypatch, cfg).save(LoopState(step=CHECKPOINT_STEP, weight_version=CHECKPOINT_STEP),
                                           cursor, partial)
    return cursor


def test_the_run_saves_the_pool_with_its_checkpoint_and_resumes_it(tmp_path, monkeypatch):
    cfg = config()
    cursor = _saved_at_checkpoint(tmp_path, monkeypatch, cfg)
    run = _run(tmp_path, monkeypatch, cfg)
    state, step = run.resume()
    assert step == CHECKPOINT_STEP and run.source.state_dict() == cursor
    assert state.partial_pool.model_dump() == read_pool_state(run.checkpoints_dir / ckpt.step_dir_name(step), 2
                                                              ).model_dump()
    assert state.partial_pool.pending


def test_a_resume_from_a_bad_pool_file_restores_nothing(tmp_path, monkeypatch):
    cfg = config()
    _saved_at_checkpoint(tmp_path, monkeypatch, cfg)
    path = tmp_path / "checkpoints" / ckpt.step_dir_name(CHECKPOINT_STEP)
    state = json.loads((path / POOL_FILE).read_text())
    state["done"] = state["pending"] = [[{"prompt_index": 0}] * 2]
    (path / POOL_FILE).write_text(json.dumps(state))
    manifest = ckpt.build_manifest(path, CHECKPOINT_STEP, "digest")  # resealed: a valid checkpoint, a wrong file
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    run = _run(tmp_path, monkeypatch, cfg)
    with pytest.raises(PartialStateError, match="not a partial-rollout pool"):
        run.resume()
    assert run.trainer.loaded == [] and run.source.state_dict() == {"epoch": 0, "offset": 0}


def test_a_torn_pool_file_makes_its_checkpoint_incomplete(tmp_path, monkeypatch):
    cfg = config()
    run = Run(cfg)
    run.steps(0, CHECKPOINT_STEP)
    cursor, partial = run.checkpoint()
    run = _run(tmp_path, monkeypatch, cfg)
    run.save(LoopState(step=1, weight_version=1), {"epoch": 0, "offset": 2}, None)
    run.save(LoopState(step=CHECKPOINT_STEP, weight_version=CHECKPOINT_STEP), cursor, partial)
    pool_path = tmp_path / "checkpoints" / ckpt.step_dir_name(CHECKPOINT_STEP) / POOL_FILE
    pool_path.write_bytes(pool_path.read_bytes()[:-10])
    state, step = _run(tmp_path, monkeypatch, cfg).resume()  # the manifest's sha256 catches it: the earlier one
    assert step == 1 and state.partial_pool is None
