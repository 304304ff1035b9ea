"""Held-out evaluation: greedy pass@1 through the same engine code that generates rollouts."""

from __future__ import annotations

from typing import Any

from miles_core.data import Prompt
from miles_core.rewards import get_reward
from miles_core.rollout.engine import EmbeddedEngine


def evaluate_greedy(engine: EmbeddedEngine, prompts: list[Prompt], reward: str,
                    max_new_tokens: int, batch_size: int) -> dict[str, Any]:
    """pass@1 of greedy decoding: the fraction of prompts whose response scores > 0."""
    score = get_reward(reward)
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    correct, examples = 0, []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        outputs = engine.generate([p.input_ids for p in chunk], params, return_logprob=False)
        for prompt, out in zip(chunk, outputs):
            ok = score(out["text"], prompt.label) > 0
            correct += ok
            if len(examples) < 8:
                examples.append({"prompt": prompt.messages, "response": out["text"],
                                 "label": prompt.label, "correct": bool(ok)})
    return {"pass@1": correct / len(prompts), "num_prompts": len(prompts), "examples": examples}
