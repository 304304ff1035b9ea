"""Custom rollouts (rollout.generate, multi-turn trajectories, filters, plugin validation) against
a scripted engine: masks and log-probs line up with the tokens, groups stay whole, engine calls
of concurrent generate functions are merged, and bad plugins fail naming the field."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from miles_core import algorithms as algo
from miles_core.config import RolloutConfig, build_config
from miles_core.driver.loop import collect_rollouts
from miles_core.plugins import load_plugin
from miles_core.preflight import _reward_problems
from miles_core.rollout.manager import RolloutManager
from miles_core.rollout.multiturn import Trajectory
from miles_core.tiny import build_tokenizer
from miles_core.training.batches import pad_batch
from miles_core.types import Prompt, Sample

TOKENIZER = build_tokenizer()
EOS = TOKENIZER.eos_token_id


def _output(ids: list[int], logprobs: list[float], finish: str = "stop") -> dict:
    return {"output_ids": ids, "text": TOKENIZER.decode(ids, skip_special_tokens=True),
            "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)],
                          "finish_reason": {"type": finish}, "weight_version": "3"}}


class ScriptedEngines:
    """Answers every prompt with the digits of its length and EOS; records each request's size."""

    num_healthy = 1

    def __init__(self):
        self.requests: list[int] = []

    def generate(self, input_ids, sampling_params, **extra):
        assert len(sampling_params) == len(input_ids)
        self.requests.append(len(input_ids))
        outs = []
        for ids in input_ids:
            answer = TOKENIZER(str(len(ids)), add_special_tokens=False)["input_ids"] + [EOS]
            outs.append(_output(answer, [-0.5] * len(answer)))
        return outs


def _prompts(count: int) -> list[Prompt]:
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": f"{i}+1="}]
        ids = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(Prompt(i, messages, str(i + 1), list(ids if isinstance(ids, list) else ids["input_ids"])))
    return prompts


def _plugin_module(**functions) -> str:
    """Register functions as a module importable by dotted path; returns its name."""
    module = types.ModuleType(f"custom_rollout_plugins_{len(sys.modules)}")
    module.__dict__.update(functions)
    sys.modules[module.__name__] = module
    return module.__name__


# ---- multi-turn trajectories ----------------------------------------------------------------------
def test_multiturn_masks_and_logprobs_align_with_the_tokens_the_policy_generated():
    prompt = Prompt(0, "q", "l", [10, 11, 12])
    trajectory = Trajectory(prompt)
    trajectory.add_generated(_output([20, 21], [-0.1, -0.2]))
    trajectory.add_observation([30, 31, 32])  # a tool result: context, not policy
    assert trajectory.input_ids == [10, 11, 12, 20, 21, 30, 31, 32]
    trajectory.add_generated(_output([22, EOS], [-0.3, -0.4]))
    sample = trajectory.to_sample("answer")
    assert sample.response_ids == [20, 21, 30, 31, 32, 22, EOS]
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1, 1]
    assert sample.rollout_logprobs == [-0.1, -0.2, 0, 0, 0, -0.3, -0.4]
    assert (sample.weight_version, sample.finish_reason) == ("3", "stop")

    batch = pad_batch([sample], pad_id=0)
    # position t predicts token t + 1: trained exactly where the next token is a policy token
    expected_mask = [0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert batch["mask"][0].tolist() == expected_mask
    policy_positions = [t for t, m in enumerate(expected_mask) if m]
    assert [int(batch["tokens"][0, t + 1]) for t in policy_positions] == [20, 21, 22, EOS]
    assert batch["rollout_logp"][0, policy_positions].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])


def test_a_turn_without_logprobs_is_refused():
    out = _output([20, 21], [-0.1, -0.2])
    out["meta_info"]["output_token_logprobs"] = []
    with pytest.raises(ValueError, match="2 tokens: generate with return_logprob"):
        Trajectory(Prompt(0, "q", "l", [1])).add_generated(out)


# ---- custom generate through the manager ------------------------------------------------------------
def fan_out(ctx, prompt, sampling_params):
    """Fan-out: half as many engine samples as the group needs; each yields two samples (the
    answer, and the answer with a token of feedback appended as context)."""
    half = sampling_params[: len(sampling_params) // 2]
    samples = []
    for out in ctx.generate([prompt.input_ids] * len(half), half):
        for feedback in ([], [TOKENIZER.convert_tokens_to_ids("!")]):
            trajectory = Trajectory(prompt)
            trajectory.add_generated(out)
            trajectory.add_observation(feedback)
            samples.append(trajectory.to_sample(ctx.tokenizer.decode(out["output_ids"], skip_special_tokens=True)))
    return samples


def two_turns(ctx, prompt, sampling_params):
    first = ctx.generate([prompt.input_ids] * len(sampling_params), sampling_params)
    trajectories = [Trajectory(prompt) for _ in first]
    for t, out in zip(trajectories, first):
        t.add_generated(out)
        t.add_observation(TOKENIZER("no", add_special_tokens=False)["input_ids"])
    second = ctx.generate([t.input_ids for t in trajectories], sampling_params)
    for t, out in zip(trajectories, second):
        t.add_generated(out)
    return [t.to_sample(ctx.tokenizer.decode(o["output_ids"], skip_special_tokens=True))
            for t, o in zip(trajectories, second)]


def _manager(engines, **rollout) -> RolloutManager:
    return RolloutManager(engines, RolloutConfig(num_samples_per_prompt=4, **rollout), "exact_match",
                          tokenizer=TOKENIZER)


def test_fan_out_generate_keeps_grpo_groups_whole():
    module = _plugin_module(fan_out=fan_out)
    engines = ScriptedEngines()
    prompts = _prompts(3)
    samples = _manager(engines, generate=f"{module}:fan_out").generate(prompts, seed=5)
    assert [s.prompt_index for s in samples] == [0] * 4 + [1] * 4 + [2] * 4  # contiguous groups, prompt order
    assert engines.requests == [6]  # three functions' calls of 2 samples each, merged into one request
    # prompt i's sequence is len(prompt) tokens: the scripted answer is that length, so the
    # reward is 1 exactly where the label matches; rewards are per sample, groups intact
    lengths = [len(p.input_ids) for p in prompts]
    assert [s.reward for s in samples] == [float(str(n) == p.label) for p, n in zip(prompts, lengths) for _ in range(4)]
    advantages = algo.grpo_advantages(torch.tensor([s.reward for s in samples]), 4)
    assert advantages.view(3, 4).sum(dim=1).abs().max() < 1e-6


def test_multi_turn_calls_are_merged_per_turn_and_each_turn_trains_only_policy_tokens():
    module = _plugin_module(two_turns=two_turns)
    engines = ScriptedEngines()
    samples = _manager(engines, generate=f"{module}:two_turns").generate(_prompts(5), seed=1)
    assert engines.requests == [20, 20]  # one request per turn for all five prompts' groups
    no = TOKENIZER("no", add_special_tokens=False)["input_ids"]
    for s in samples:
        first = s.response_ids.index(EOS) + 1
        assert s.response_ids[first : first + len(no)] == no
        assert s.loss_mask == [1.0] * first + [0.0] * len(no) + [1.0] * (len(s.response_ids) - first - len(no))


def test_a_merged_request_is_split_into_one_contiguous_shard_per_engine():
    module = _plugin_module(two_turns=two_turns)
    engines = ScriptedEngines()
    engines.num_healthy = 3
    prompts = _prompts(12)[7:]  # "10+1=" and "11+1=" are longer: their answers differ
    samples = _manager(engines, generate=f"{module}:two_turns").generate(prompts, seed=1)
    assert sorted(engines.requests) == [6, 6, 7, 7, 7, 7]  # 20 sequences a turn over 3 engines
    # each sample's answer is its own prompt's length: outputs came back in prompt order
    no = TOKENIZER("no", add_special_tokens=False)["input_ids"]
    length = {p.index: len(p.input_ids) for p in prompts}
    assert len(set(length.values())) == 2
    for s in samples:
        answer = TOKENIZER(str(length[s.prompt_index]), add_special_tokens=False)["input_ids"] + [EOS]
        assert s.response_ids[: len(answer)] == answer
        assert s.response_ids[len(answer) : len(answer) + len(no)] == no


def test_a_generate_returning_the_wrong_group_size_fails_naming_the_field():
    module = _plugin_module(short=lambda ctx, prompt, sampling_params: [])
    with pytest.raises(ValueError, match=r"rollout.generate returned list of 0 .* num_samples_per_prompt=4"):
        _manager(ScriptedEngines(), generate=f"{module}:short").generate(_prompts(2), seed=0)


def test_an_engine_error_reaches_every_waiting_generate_function():
    class Failing(ScriptedEngines):
        def generate(self, input_ids, sampling_params, **extra):
            raise ConnectionError("engine gone")

    module = _plugin_module(two_turns=two_turns)
    with pytest.raises(ConnectionError, match="engine gone"):
        _manager(Failing(), generate=f"{module}:two_turns").generate(_prompts(3), seed=0)


# ---- filters ---------------------------------------------------------------------------------------
def test_sample_filter_masks_samples_and_group_filter_drops_groups():
    module = _plugin_module(not_first=lambda sample: sample.prompt_index != 0,
                            keep_odd=lambda samples: samples[0].prompt_index % 2 == 1)
    cfg = build_config({}, ["rollout.num_samples_per_prompt=4", "rollout.num_prompts_per_step=4",
                            f"rollout.sample_filter={module}:not_first", f"rollout.group_filter={module}:keep_odd"])

    class Source:
        def next_batch(self, size):
            return _prompts(size)

    manager = RolloutManager(ScriptedEngines(), cfg.rollout, "exact_match", tokenizer=TOKENIZER)
    samples = manager.generate(_prompts(4), seed=0)
    assert [s.filtered for s in samples] == [True] * 4 + [False] * 12
    assert all(s.loss_mask == [0.0] * len(s.response_ids) for s in samples[:4])
    kept, metrics = collect_rollouts(cfg, manager, Source(), seed=0)
    assert [s.prompt_index for s in kept] == [1] * 4 + [3] * 4
    assert metrics == {"rollout/filtered_groups": 2.0}

    none = _plugin_module(drop_all=lambda samples: False)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"group_filter": f"{none}:drop_all"})})
    manager = RolloutManager(ScriptedEngines(), cfg.rollout, "exact_match", tokenizer=TOKENIZER)
    with pytest.raises(RuntimeError, match="group_filter dropped all 4 groups"):
        collect_rollouts(cfg, manager, Source(), seed=0)


# ---- plugin validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "path", "message"), [
    ("rollout.generate", "no_such_module_xyz:generate", "cannot import 'no_such_module_xyz'"),
    ("rollout.generate", "miles_core.rewards:no_such_function", "has no function 'no_such_function'"),
    ("rollout.generate", "miles_core.rewards:exact_match", r"must take \(ctx, prompt, sampling_params\)"),
    ("rollout.sample_filter", "miles_core.rollout.self_correction:generate", r"must take \(sample\)"),
    ("rollout.group_filter", "miles_core.rewards:exact_match", r"must take \(samples\)"),
    ("rollout.reward", "miles_core.rollout.self_correction:generate", r"must take \(response, label\)"),
])
def test_a_bad_plugin_fails_validation_naming_the_field(field, path, message):
    cfg = build_config({}, [f"{field}={path}"])
    problems = list(_reward_problems(cfg))
    assert len(problems) == 1 and problems[0].startswith(f"{field}: ")
    assert pytest.raises(ValueError, load_plugin, path, field).match(message)


def test_the_built_in_example_plugins_validate():
    cfg = build_config({}, ["rollout.generate=miles_core.rollout.self_correction:generate"])
    assert list(_reward_problems(cfg)) == []


def test_self_correction_retries_only_wrong_answers_with_feedback_as_context():
    engines = ScriptedEngines()
    prompts = _prompts(2)  # labels "1" and "2"; the scripted answer is the prompt's length
    samples = _manager(engines, generate="miles_core.rollout.self_correction:generate").generate(prompts, seed=0)
    assert engines.requests == [8, 8]  # every first answer is wrong: all eight answer again, in one request
    feedback = TOKENIZER.apply_chat_template([{"role": "user", "content": "no. 0+1="}], add_generation_prompt=True,
                                             tokenize=True)
    feedback = list(feedback if isinstance(feedback, list) else feedback["input_ids"])
    first = samples[0]
    turn = first.response_ids.index(EOS) + 1
    assert first.response_ids[turn : turn + len(feedback)] == feedback
    assert first.loss_mask[turn : turn + len(feedback)] == [0.0] * len(feedback)
    second_answer = TOKENIZER.decode(first.response_ids[turn + len(feedback):], skip_special_tokens=True)
    assert first.response_text == second_answer  # the reward scores the final answer
    assert isinstance(first, Sample)


def one_dict_for_all(ctx, prompt, sampling_params):
    """The SGLang habit of one params dict for a whole batch: refused, in this function only."""
    ctx.generate([prompt.input_ids] * 4, sampling_params[0])


def test_a_malformed_engine_call_fails_its_function_without_holding_the_others():
    module = _plugin_module(bad=one_dict_for_all)
    with pytest.raises(ValueError, match="one sampling_params dict per prompt"):
        _manager(ScriptedEngines(), generate=f"{module}:bad").generate(_prompts(3), seed=0)


def test_samples_that_would_train_wrongly_are_refused_naming_the_prompt():
    def short_mask(ctx, prompt, sampling_params):
        samples = two_turns(ctx, prompt, sampling_params)
        samples[1].loss_mask = samples[1].loss_mask[:1]
        return samples

    def same_object(ctx, prompt, sampling_params):
        return [two_turns(ctx, prompt, sampling_params)[0]] * len(sampling_params)

    module = _plugin_module(short_mask=short_mask, same_object=same_object)
    with pytest.raises(ValueError, match=r"prompt 0: loss_mask has 1 entries for \d+ response tokens"):
        _manager(ScriptedEngines(), generate=f"{module}:short_mask").generate(_prompts(1), seed=0)
    with pytest.raises(ValueError, match="same Sample object appears twice"):
        _manager(ScriptedEngines(), generate=f"{module}:same_object").generate(_prompts(1), seed=0)


def test_a_plugin_module_that_fails_to_import_is_reported_on_the_field(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin_xyz.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"rollout.sample_filter: importing 'broken_plugin_xyz' failed: "
                                         r"RuntimeError: no GPU here"):
        load_plugin("broken_plugin_xyz:keep", "rollout.sample_filter")


def test_evaluation_can_score_the_episodes_of_rollout_generate():
    from miles_core.evaluation.core import evaluate_dataset
    from miles_core.rollout import self_correction

    class Engine:
        tokenizer = TOKENIZER

        def generate(self, input_ids, sampling_params, return_logprob=False, **extra):
            assert isinstance(sampling_params, (list, dict))
            return ScriptedEngines().generate(input_ids, sampling_params if isinstance(sampling_params, list)
                                              else [sampling_params] * len(input_ids))

    prompt = _prompts(1)[0]
    first = len(prompt.input_ids)  # the scripted first answer: wrong for a label of the retry's length
    retry = Trajectory(prompt)
    retry.add_generated(_output(TOKENIZER(str(first), add_special_tokens=False)["input_ids"] + [EOS], [0.0] * 3))
    feedback = TOKENIZER.apply_chat_template([{"role": "user", "content": "no. 0+1="}], add_generation_prompt=True,
                                             tokenize=True)
    prompt.label = str(len(retry.input_ids) + len(list(feedback if isinstance(feedback, list)
                                                          else feedback["input_ids"])))
    single = evaluate_dataset(Engine(), [prompt], "exact_match", max_new_tokens=4, batch_size=8)
    episodes = evaluate_dataset(Engine(), [prompt], "exact_match", max_new_tokens=4, batch_size=8,
                                generate_fn=self_correction.generate)
    assert (single.pass_at_1, episodes.pass_at_1) == (0.0, 1.0)  # right on the second try
    assert episodes.examples[0]["responses"] == [prompt.label]


def test_eval_with_rollout_generate_needs_one():
    with pytest.raises(Exception, match="eval.use_rollout_generate evaluates with rollout.generate"):
        build_config({}, ["eval.use_rollout_generate=true"])
    cfg = build_config({}, ["eval.use_rollout_generate=true", "rollout.generate=miles_core.rollout.self_correction:generate"])
    assert cfg.eval.use_rollout_generate
