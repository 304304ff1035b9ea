"""Per-prompt generation budgets (Prompt.max_new_tokens): read from the dataset, sent to the
engines, and kept by a partial sample through its continuation and a checkpoint."""

from __future__ import annotations

import json

import pytest

from miles_core.config import DataConfig, RolloutConfig
from miles_core.data import read_prompts
from miles_core.rollout.manager import RolloutManager
from miles_core.rollout.partial_pool import PartialPool
from miles_core.rollout.partial_state import PoolRecord
from miles_core.tiny import build_tokenizer
from miles_core.types import Prompt, Sample
from tests.unit.test_partial_rollouts import LONG, PROMPTS, StubEngines, reference

BUDGET = 30
"""LONG's own budget; its scripted response is 400 tokens and the recipe's budget 500."""


def _manager(engines: StubEngines, n: int = 1, **rollout) -> RolloutManager:
    cfg = RolloutConfig(num_samples_per_prompt=n, max_new_tokens=500, num_prompts_per_step=2, **rollout)
    return RolloutManager(engines, cfg, "exact_match")


def _long(budget: int | None = BUDGET) -> Prompt:
    return Prompt(LONG.index, LONG.messages, LONG.label, LONG.input_ids, max_new_tokens=budget)


def test_a_cut_sample_continues_within_its_prompts_budget():
    engines = StubEngines()
    manager = _manager(engines)
    engines.pause_after = 10  # a weight update cuts it after 10 of its 30 tokens
    samples = manager.generate([_long()], seed=1)
    assert samples[0].finish_reason == "abort" and samples[0].max_new_tokens == BUDGET
    engines.version, engines.pause_after = 1, None
    manager.continue_partial(samples, seed=2)
    sample = samples[0]
    assert (len(sample.response_ids), sample.finish_reason) == (BUDGET, "length")  # not 400 under the recipe's 500
    assert sample.response_ids == reference(LONG.input_ids, [0] * 10 + [1] * 20)[0]


def test_a_sample_cut_at_its_prompts_budget_is_done_without_another_engine_call():
    engines = StubEngines()
    cut = Sample(LONG.index, LONG.input_ids, list(range(10, 10 + BUDGET)), "z", rollout_logprobs=[-0.1] * BUDGET,
                 finish_reason="abort", max_new_tokens=BUDGET)
    _manager(engines).continue_partial([cut], seed=2)
    assert (cut.finish_reason, len(cut.response_ids), engines.calls) == ("length", BUDGET, [])


def test_a_checkpointed_cut_sample_keeps_its_budget(tmp_path):
    engines = StubEngines()
    pool = PartialPool(_manager(engines), 1, max_staleness_versions=2)
    engines.pause_after = 10
    pool.round([_long()], version=0, seed=1)
    saved = json.loads(json.dumps(pool.state_dict()))  # as written to and read from the checkpoint
    resumed = PartialPool(_manager(engines), 1, max_staleness_versions=2)
    resumed.restore(PoolRecord.model_validate(saved))
    engines.version, engines.pause_after = 1, None
    resumed.round([], version=1, seed=2)
    (sample,) = resumed.take(1)
    assert (len(sample.response_ids), sample.max_new_tokens) == (BUDGET, BUDGET)


def test_prompts_of_different_budgets_go_in_separate_engine_calls_in_prompt_order():
    engines, seen = StubEngines(), []
    engines.generate = lambda ids, params, **extra: (seen.append({p["max_new_tokens"] for p in params}),
                                                     StubEngines.generate(engines, ids, params))[1]
    samples = _manager(engines, n=2, ignore_eos=True).generate([PROMPTS[0], _long(7), PROMPTS[1]], seed=1)
    assert sorted(map(sorted, seen)) == [[7], [500]]  # one budget per call: what the embedded engine takes
    assert [s.prompt_index for s in samples] == [0, 0, 2, 2, 1, 1]
    assert [len(s.response_ids) for s in samples[2:4]] == [7, 7]


def test_ignore_eos_is_sent_only_when_set():
    manager = _manager(StubEngines())
    assert "ignore_eos" not in manager.sampling_params([1])[0]
    assert _manager(StubEngines(), ignore_eos=True).sampling_params([1], 9)[0] | {"sampling_seed": 0} == {
        "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 0}


def test_the_dataset_row_key_sets_the_budget_and_a_bad_one_names_its_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "1+1=", "label": "2", "budget": 40}, {"prompt": "2+2=", "label": "4"}]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    tokenizer = build_tokenizer()
    assert [p.max_new_tokens for p in read_prompts(path, DataConfig(max_new_tokens_key="budget"), tokenizer)] == [40, None]
    assert [p.max_new_tokens for p in read_prompts(path, DataConfig(), tokenizer)] == [None, None]  # key unset: ignored
    for bad in (0, 12.5, True, "40"):
        path.write_text(json.dumps(rows[1]) + "\n" + json.dumps(rows[0] | {"budget": bad}) + "\n")
        with pytest.raises(ValueError, match=r"rows.jsonl:2: row key 'budget': .*integer >= 1"):
            read_prompts(path, DataConfig(max_new_tokens_key="budget"), tokenizer)
