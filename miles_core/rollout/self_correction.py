"""A built-in multi-turn environment: answer, then correct yourself after feedback.

The policy answers the prompt. A wrong answer gets a user turn "no. <the question again>"
(tokens the policy did not write: loss mask 0), and the policy answers once more. The sample's
response_text is the final answer, so a registered reward (exact_match) scores the episode.
It runs on the tiny model (`configs/local-multiturn.yaml`) and is the worked example of
`rollout.generate` (README, "Custom rollouts"):

    rollout:
      generate: miles_core.rollout.self_correction:generate
"""

from __future__ import annotations

from typing import Any

from miles_core.rewards import exact_match
from miles_core.rollout.context import RolloutContext
from miles_core.rollout.multiturn import Trajectory
from miles_core.types import Prompt, Sample

SECOND_TURN_SEED_OFFSET = 1 << 40  # the retry draws other randomness than the first answer


def _question(prompt: Prompt) -> str:
    if isinstance(prompt.messages, str):
        return prompt.messages
    return next(m["content"] for m in reversed(prompt.messages) if m["role"] == "user")


def _answer(ctx: RolloutContext, output: dict[str, Any]) -> str:
    return ctx.tokenizer.decode(output["output_ids"], skip_special_tokens=True)


def generate(ctx: RolloutContext, prompt: Prompt, sampling_params: list[dict[str, Any]]) -> list[Sample]:
    """One group: each of the n samples answers, and those that were wrong answer again."""
    trajectories = [Trajectory(prompt) for _ in sampling_params]
    answers = []
    for trajectory, output in zip(trajectories, ctx.generate([prompt.input_ids] * len(sampling_params),
                                                             sampling_params)):
        trajectory.add_generated(output)
        answers.append(_answer(ctx, output))
    retry = [i for i, (t, a) in enumerate(zip(trajectories, answers))
             if t.finish_reason == "stop" and not exact_match(a, prompt.label)]
    if retry:
        feedback = ctx.tokenizer.apply_chat_template([{"role": "user", "content": f"no. {_question(prompt)}"}],
                                                     add_generation_prompt=True, tokenize=True)
        feedback = list(feedback if isinstance(feedback, list) else feedback["input_ids"])
        for i in retry:
            trajectories[i].add_observation(feedback)
        params = [sampling_params[i] | {"sampling_seed": sampling_params[i].get("sampling_seed", 0)
                                        + SECOND_TURN_SEED_OFFSET} for i in retry]
        for i, output in zip(retry, ctx.generate([trajectories[i].input_ids for i in retry], params)):
            trajectories[i].add_generated(output)
            answers[i] = _answer(ctx, output)
    return [t.to_sample(response_text=a) for t, a in zip(trajectories, answers)]
