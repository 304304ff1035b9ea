"""DAPO dynamic sampling in the loop: all-equal groups dropped and counted, over-sampling
refills the batch in draw order, a short batch is an explicit decision."""

import logging

import pytest

from miles_core.config import build_config
from miles_core.data import PromptSource
from miles_core.driver.loop import collect_rollouts
from miles_core.types import Prompt, Sample

N = 4  # samples per prompt


class StubManager:
    """Rewards by prompt index: a prompt whose index is in `flat` gets n equal rewards (a
    group without signal), any other prompt gets rewards 0, 1, 0, 1."""

    def __init__(self, flat: set[int]):
        self.flat, self.calls = flat, []

    def generate(self, prompts: list[Prompt], seed: int) -> list[Sample]:
        self.calls.append(([p.index for p in prompts], seed))
        return [Sample(p.index, [1], [2], p.label, reward=1.0 if p.index in self.flat else float(j % 2))
                for p in prompts for j in range(N)]

    def keep_groups(self, samples: list[Sample]) -> list[bool]:
        return [True] * (len(samples) // N)


def setup(flat: set[int], num_prompts: int = 16, *overrides: str):
    cfg = build_config({}, ["algorithm.dynamic_sampling=true", "rollout.num_prompts_per_step=4",
                            f"rollout.num_samples_per_prompt={N}", *overrides])
    prompts = [Prompt(i, f"{i}+0=", str(i), [1]) for i in range(num_prompts)]
    source = PromptSource(prompts, seed=0)
    source._order = list(range(num_prompts))  # draw order = index order, to know what comes next
    return cfg, StubManager(flat), source


def groups_of(samples: list[Sample]) -> list[int]:
    return [s.prompt_index for s in samples[::N]]


def test_all_equal_groups_are_dropped_and_oversampling_refills_in_draw_order():
    cfg, manager, source = setup(flat={1, 2, 5})
    samples, metrics = collect_rollouts(cfg, manager, source, seed=100)
    assert groups_of(samples) == [0, 3, 4, 6]  # prompts 1, 2 and 5 carried no signal
    assert all(len({s.prompt_index for s in samples[i:i + N]}) == 1 for i in range(0, len(samples), N))
    assert metrics == {"rollout/dropped_groups": 3.0, "rollout/sampling_rounds": 2.0,
                       "rollout/kept_groups": 4.0, "rollout/short_batch": 0.0}
    assert [seed for _, seed in manager.calls] == [100, 100 + 7919]  # each round its own seed
    assert source.state_dict() == {"epoch": 0, "offset": 8}  # two rounds of 4 prompts drawn


def test_a_full_first_round_needs_no_oversampling():
    cfg, manager, source = setup(flat=set())
    samples, metrics = collect_rollouts(cfg, manager, source, seed=0)
    assert groups_of(samples) == [0, 1, 2, 3] and len(manager.calls) == 1
    assert metrics["rollout/dropped_groups"] == 0 and metrics["rollout/short_batch"] == 0


def test_rounds_running_out_train_a_short_batch_with_a_warning(caplog):
    cfg, manager, source = setup({0, 1, 2, 4, 5, 6}, 16, "algorithm.max_sampling_rounds=2")
    with caplog.at_level(logging.WARNING, logger="miles_core.driver.loop"):
        samples, metrics = collect_rollouts(cfg, manager, source, seed=0)
    assert groups_of(samples) == [3, 7]
    assert metrics["rollout/short_batch"] == 1.0 and metrics["rollout/kept_groups"] == 2.0
    assert "kept 2 of 4 groups after 2 rounds" in caplog.text


def test_short_batch_fail_policy_raises_with_the_fix():
    cfg, manager, source = setup({0, 1, 2, 4, 5, 6}, 16, "algorithm.max_sampling_rounds=2",
                                 "algorithm.short_batch=fail")
    with pytest.raises(RuntimeError, match="kept 2 of 4 groups.*max_sampling_rounds"):
        collect_rollouts(cfg, manager, source, seed=0)


def test_no_group_kept_always_fails():
    cfg, manager, source = setup(set(range(16)), 16, "algorithm.max_sampling_rounds=3")
    with pytest.raises(RuntimeError, match="kept 0 of 4 groups after 3 rounds"):
        collect_rollouts(cfg, manager, source, seed=0)


def test_without_dynamic_sampling_every_group_is_kept():
    cfg, manager, source = setup(flat={0, 1, 2, 3})
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"dynamic_sampling": False})})
    samples, metrics = collect_rollouts(cfg, manager, source, seed=0)
    assert groups_of(samples) == [0, 1, 2, 3] and metrics == {}
