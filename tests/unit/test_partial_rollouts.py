"""Partial rollouts (issue 42): per-token weight versions, pause + continue, per-token correction."""

from __future__ import annotations

import math
import threading
import time
import types

import pytest
import torch

from miles_core import objectives
from miles_core.config import AlgorithmConfig, RolloutConfig
from miles_core.rollout.manager import RolloutManager
from miles_core.rollout.partial import append_segment, version_metrics
from miles_core.training.batches import mixed_version_fraction, pad_batch
from miles_core.types import Prompt, Sample, token_versions

PROMPTS = [Prompt(0, "a", "x", [3, 4, 5]), Prompt(1, "b", "y", [6, 7])]
LONG = Prompt(2, "c", "z", [8, 8, 9])
LENGTHS = {(3, 4, 5): 9, (6, 7): 3, (8, 8, 9): 400}
"""Scripted long tail: prompt 0's response is 9 tokens long, prompt 1's 3, LONG's 400."""


def policy(context: list[int], version: int) -> tuple[int, float]:
    """The stub's model at one weight version: the next token and its log-prob, from the whole
    context (so a continuation that re-prefills prompt + partial response picks up exactly)."""
    h = sum((i + 1) * t for i, t in enumerate(context))
    return 10 + (h * 31 + version * 17) % 50, -0.05 - ((h + 3 * version) % 11) / 10


class StubEngines:
    """Engines with the policy above at `version`; a call stops each sequence after `pause_after`
    new tokens with finish_reason abort (a pause for a weight update), else at its scripted length
    (stop) or its budget (length)."""

    num_healthy = 1

    def __init__(self):
        self.version, self.pause_after, self.calls = 0, None, []

    def generate(self, input_ids, sampling_params, **extra):
        self.calls.append([list(ids) for ids in input_ids])
        return [self._one(list(ids), params["max_new_tokens"]) for ids, params in zip(input_ids, sampling_params)]

    def _one(self, ids: list[int], budget: int) -> dict:
        prompt = next(p for p in LENGTHS if tuple(ids[: len(p)]) == p)
        new, logprobs, finish = [], [], "length"
        while len(new) < budget:
            if len(ids) + len(new) - len(prompt) >= LENGTHS[prompt]:
                finish = "stop"
                break
            if self.pause_after is not None and len(new) >= self.pause_after:
                finish = "abort"
                break
            token, logprob = policy(ids + new, self.version)
            new.append(token)
            logprobs.append(logprob)
        return {"output_ids": new, "text": "".join(chr(65 + t % 26) for t in new),
                "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, new)],
                              "finish_reason": {"type": finish}, "weight_version": str(self.version)}}


def reference(prompt: list[int], versions: list[int]) -> tuple[list[int], list[float]]:
    """By hand: token i sampled by the policy at versions[i] from prompt + tokens before it."""
    ids, logprobs = [], []
    for version in versions:
        token, logprob = policy(prompt + ids, version)
        ids.append(token)
        logprobs.append(logprob)
    return ids, logprobs


def _manager(engines: StubEngines, max_new_tokens: int = 16) -> RolloutManager:
    rollout = RolloutConfig(num_samples_per_prompt=1, max_new_tokens=max_new_tokens, num_prompts_per_step=2)
    return RolloutManager(engines, rollout, "exact_match")


def test_a_sample_paused_and_continued_equals_one_generated_with_the_same_per_token_weights():
    engines = StubEngines()
    manager = _manager(engines)
    engines.pause_after = 4
    samples = manager.generate(PROMPTS, seed=1)
    assert [s.finish_reason for s in samples] == ["abort", "stop"]
    engines.version, engines.pause_after = 1, 3  # a weight update, then another pause
    manager.continue_partial(samples, seed=2)
    assert engines.calls[-1] == [PROMPTS[0].input_ids + samples[0].response_ids[:4]]  # re-prefill of the partial
    engines.version, engines.pause_after = 2, None
    manager.continue_partial(samples, seed=3)
    long, short = samples
    ids, logprobs = reference(PROMPTS[0].input_ids, [0] * 4 + [1] * 3 + [2] * 2)
    assert long.response_ids == ids and long.rollout_logprobs == pytest.approx(logprobs)
    assert long.token_weight_versions == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert (long.finish_reason, long.weight_version) == ("stop", "2")
    ids, logprobs = reference(PROMPTS[1].input_ids, [0, 0, 0])
    assert (short.response_ids, short.rollout_logprobs, short.token_weight_versions) == (ids, logprobs, [0, 0, 0])


def test_the_budget_covers_every_segment():
    engines = StubEngines()
    manager = _manager(engines, max_new_tokens=6)
    engines.pause_after = 4
    samples = manager.generate(PROMPTS[:1], seed=1)
    engines.version, engines.pause_after = 1, None
    manager.continue_partial(samples, seed=2)
    assert len(samples[0].response_ids) == 6 and samples[0].finish_reason == "length"
    assert samples[0].token_weight_versions == [0, 0, 0, 0, 1, 1]


def test_each_continued_sample_gets_its_own_fresh_seed():
    engines = StubEngines()
    seen = []
    engines.generate = lambda ids, params, **extra: (seen.append([p["sampling_seed"] for p in params]),
                                                     StubEngines.generate(engines, ids, params))[1]
    rollout = RolloutConfig(num_samples_per_prompt=2, max_new_tokens=16, num_prompts_per_step=1)
    manager = RolloutManager(engines, rollout, "exact_match")
    engines.pause_after = 2
    samples = manager.generate(PROMPTS[:1], seed=1)
    manager.continue_partial(samples, seed=2)
    first, continued = seen
    assert len(set(first + continued)) == 4  # the group's two samples, twice: no noise replayed or shared


def test_per_token_versions_reach_the_trainer_batch():
    one = Sample(0, [1, 2], [5, 6, 7], "", rollout_logprobs=[-1.0, -2.0, -3.0], token_weight_versions=[3, 3, 4])
    plain = Sample(0, [1, 2, 3], [8], "", weight_version="4")  # no per-token list: its weight_version
    batch = pad_batch([one, plain], pad_id=0)
    assert batch["token_version"].tolist() == [[-1, 3, 3, 4], [-1, -1, 4, -1]]
    assert mixed_version_fraction(batch) == 0.5
    assert token_versions(Sample(0, [1], [2, 3], "", weight_version="default")) == [0, 0]


def test_version_metrics_count_tokens_per_version_and_mixed_samples():
    samples = [Sample(0, [1], [5, 6, 7], "", token_weight_versions=[3, 3, 4]),
               Sample(0, [1], [8], "", weight_version="4")]
    assert version_metrics(samples) == {"rollout/mixed_version_sample_frac": 0.5,
                                        "rollout/tokens_behind_1": 2.0, "rollout/tokens_behind_0": 2.0}


def test_the_correction_uses_each_tokens_behaviour_logprob_across_segments():
    engines = StubEngines()
    manager = _manager(engines)
    engines.pause_after = 2
    samples = manager.generate(PROMPTS[:1], seed=1)
    engines.version, engines.pause_after = 1, None
    manager.continue_partial(samples, seed=2)
    sample = samples[0]
    behaviour = [policy(sample.prompt_ids + sample.response_ids[:i], v)[1]
                 for i, v in enumerate([0, 0] + [1] * 7)]
    batch = pad_batch(samples, pad_id=0)
    start = len(sample.prompt_ids) - 1
    trainer = torch.full_like(batch["rollout_logp"], -0.5)
    batch["old_logp"] = trainer * batch["mask"]
    cfg = AlgorithmConfig(correction={"kind": "tis", "low": 0.0, "high": 100.0})
    weights = objectives.importance_weights(cfg, batch)[0, start : start + 9]
    assert weights.tolist() == pytest.approx([math.exp(-0.5 - lp) for lp in behaviour], rel=1e-5)


def test_a_segment_aborted_before_it_ran_leaves_the_sample_as_it_was():
    sample = Sample(0, [1], [5], "", rollout_logprobs=[-1.0], token_weight_versions=[0], finish_reason="abort")
    out = {"output_ids": [], "text": "", "meta_info": {"output_token_logprobs": [], "weight_version": "1",
                                                       "finish_reason": {"type": "abort"}}}
    append_segment(sample, out)
    assert (sample.response_ids, sample.rollout_logprobs, sample.token_weight_versions) == ([5], [-1.0], [0])
    assert sample.finish_reason == "abort"


def test_a_segment_without_logprobs_cannot_extend_one_with_them():
    sample = Sample(0, [1], [5], "", rollout_logprobs=[-1.0], finish_reason="abort")
    out = {"output_ids": [6], "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": "1"}}
    with pytest.raises(ValueError, match="log-probs of every segment"):
        append_segment(sample, out)


# ---- config ----------------------------------------------------------------------------------------
def test_partial_rollouts_need_the_fully_async_loop_and_a_per_token_correction():
    from miles_core.config import ConfigError, build_config

    ok = build_config({"rollout": {"loop": "fully_async"}},
                      ["rollout.partial.enabled=true", "algorithm.correction.kind=mis",
                       "rollout.partial.max_staleness_versions=3"])
    assert (ok.rollout.partial.enabled, ok.rollout.partial.max_staleness_versions) == (True, 3)
    with pytest.raises(ConfigError, match="needs rollout.loop=fully_async .*set rollout.loop.kind=fully_async"):
        build_config({}, ["rollout.partial.enabled=true", "algorithm.correction.kind=tis"])
    with pytest.raises(ConfigError, match="set algorithm.correction.kind=tis or mis"):
        build_config({"rollout": {"loop": "fully_async"}},
                     ["rollout.partial.enabled=true", "algorithm.correction.kind=icepop"])
    with pytest.raises(ConfigError, match="set algorithm.correction.kind=tis or mis"):  # the ratio alone: not enough
        build_config({"rollout": {"loop": "fully_async"}},
                     ["rollout.partial.enabled=true", "algorithm.old_logprob_source=rollout"])
    with pytest.raises(ConfigError, match="unset algorithm.dynamic_sampling, or set rollout.partial.enabled=false"):
        build_config({"rollout": {"loop": "fully_async"}},
                     ["rollout.partial.enabled=true", "algorithm.correction.kind=tis", "algorithm.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="max_staleness_versions"):
        build_config({}, ["rollout.partial.max_staleness_versions=-1"])


# ---- the producer's pool ---------------------------------------------------------------------------
def _pool(engines: StubEngines, max_staleness: int = 2):
    from miles_core.rollout.partial_pool import PartialPool

    rollout = RolloutConfig(num_samples_per_prompt=2, max_new_tokens=16, num_prompts_per_step=2)
    return PartialPool(RolloutManager(engines, rollout, "exact_match"), 2, max_staleness)


def test_the_long_tail_group_is_kept_across_an_update_and_trains_once_done():
    engines = StubEngines()
    pool = _pool(engines)
    engines.pause_after = 4  # the update's pause cuts prompt 0's 9-token responses
    pool.round(PROMPTS, version=0, seed=1)
    assert [len(g) for g in pool.done] == [2] and pool.done[0][0].prompt_index == 1
    assert pool.take(2) is None and len(pool.pending) == 1
    engines.version, engines.pause_after = 1, None
    pool.round([], version=1, seed=2)
    batch = pool.take(2)
    assert [s.prompt_index for s in batch] == [1, 1, 0, 0]
    ids, _ = reference(PROMPTS[0].input_ids, [0] * 4 + [1] * 5)
    assert batch[2].response_ids == ids and batch[2].token_weight_versions == [0] * 4 + [1] * 5
    metrics = pool.metrics(batch)
    assert metrics["rollout/mixed_version_sample_frac"] == 0.5
    assert (metrics["rollout/tokens_behind_1"], metrics["rollout/tokens_behind_0"]) == (3 * 2 + 4 * 2, 5 * 2)
    assert metrics["rollout/partial_tokens_thrown_away"] == 0


def test_partial_groups_too_stale_are_thrown_away_and_counted():
    engines = StubEngines()
    pool = _pool(engines, max_staleness=2)
    engines.pause_after = 2
    pool.round(PROMPTS[:1], version=0, seed=1)
    engines.version = 1
    pool.round([], version=1, seed=2)  # paused again: 2 tokens at version 0, 2 at version 1
    assert len(pool.pending) == 1 and pool.pending[0][0].token_weight_versions == [0, 0, 1, 1]
    engines.version = 3  # its oldest token is 3 versions behind: more than max_staleness_versions=2
    pool.round([], version=3, seed=3)
    assert pool.pending == [] and pool.done == []
    assert (pool.tokens_thrown_away, pool.groups_thrown_away) == (8, 1)


def test_a_group_waits_for_its_last_sample():
    from miles_core.rollout.partial_pool import PartialPool

    class HalfManager:  # continues only the first partial sample it is given
        def continue_partial(self, samples, seed):
            next(s for s in samples if s.finish_reason == "abort").finish_reason = "stop"

    pool = PartialPool(HalfManager(), 2, 5)
    pool.pending = [[Sample(0, [1], [2], "", finish_reason="abort"), Sample(0, [1], [3], "", finish_reason="abort")]]
    pool.round([], version=0, seed=0)
    assert pool.done == [] and len(pool.pending) == 1
    pool.round([], version=0, seed=0)
    assert len(pool.done) == 1 and pool.pending == []


# ---- the fully async schedule with rollout.partial ---------------------------------------------


class PausableEngines(StubEngines):
    """StubEngines one token at a time, with /pause_generation mode=abort (running and new
    requests return what they have, finish_reason abort) and /continue_generation."""

    def __init__(self):
        super().__init__()
        self.paused, self.pauses, self.tokens_made = False, [], threading.Event()

    def pause(self, mode: str) -> None:
        self.pauses.append(mode)
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def _one(self, ids, budget):
        out = {"output_ids": [], "meta_info": {"output_token_logprobs": [], "weight_version": str(self.version),
                                               "finish_reason": {"type": "length"}}, "text": ""}
        for _ in range(budget):
            if self.paused:
                out["meta_info"]["finish_reason"] = {"type": "abort"}
                return out
            one = StubEngines._one(self, ids + out["output_ids"], 1)
            out["output_ids"] += one["output_ids"]
            out["meta_info"]["output_token_logprobs"] += one["meta_info"]["output_token_logprobs"]
            out["meta_info"]["finish_reason"] = one["meta_info"]["finish_reason"]
            if len(out["output_ids"]) == 20:
                self.tokens_made.set()
            if one["meta_info"]["finish_reason"]["type"] == "stop":
                break
            time.sleep(0.005)
        return out


def test_fully_async_with_partial_rollouts_continues_a_sample_cut_by_a_weight_update():
    from miles_core.config import build_config
    from miles_core.driver.loop import make_partial_producer
    from miles_core.driver.schedules import FullyAsyncSchedule

    cfg = build_config({"rollout": {"loop": "fully_async"}},
                       ["rollout.partial.enabled=true", "algorithm.correction.kind=tis", "algorithm.name=ppo",
                        "rollout.num_samples_per_prompt=1", "rollout.num_prompts_per_step=1",
                        "rollout.max_new_tokens=500"])
    engines = PausableEngines()
    source = types.SimpleNamespace(queue=[PROMPTS[1], LONG], state_dict=dict)
    source.next_batch = lambda k: [source.queue.pop(0) for _ in range(k)]
    run = types.SimpleNamespace(cfg=cfg, source=source)
    schedule = FullyAsyncSchedule(make_partial_producer(run, RolloutManager(engines, cfg.rollout, "exact_match")),
                                  cfg, engines=engines)
    try:
        first = schedule.next(0, 0)
        assert [s.prompt_index for s in first.samples] == [1]
        assert engines.tokens_made.wait(60)  # the long sample is running at version 0
        with schedule.hold_engines():
            engines.version = 1  # the weight push
        second = schedule.next(1, 1)
    finally:
        schedule.close()
    sample = second.samples[0]
    cut = sample.token_weight_versions.index(1)
    assert engines.pauses[0] == "abort" and 20 <= cut < 400 and len(sample.response_ids) == 400
    ids, logprobs = reference(LONG.input_ids, [0] * cut + [1] * (400 - cut))
    assert sample.response_ids == ids and sample.rollout_logprobs == pytest.approx(logprobs)
    assert second.metrics["rollout/mixed_version_sample_frac"] == 1.0
    assert second.metrics["rollout/tokens_behind_1"] == cut
