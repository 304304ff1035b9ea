"""Reward functions: an explicit registry of `name -> fn(response_text, label) -> float`."""

from __future__ import annotations

import importlib
import re
from typing import Callable

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}


def register(name: str):
    def add(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return add


def _normalise_number(text: str) -> str:
    text = text.strip().replace(",", "").rstrip(".")
    if text.startswith("+"):
        text = text[1:]
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


@register("exact_match")
def exact_match(response: str, label: str) -> float:
    """1.0 when the response (whitespace-stripped) equals the label, numbers normalised."""
    return float(_normalise_number(response) == _normalise_number(label))


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in text, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


@register("math_boxed")
def math_boxed(response: str, label: str) -> float:
    """1.0 when the last \\boxed{} answer equals the label (numbers normalised)."""
    answer = last_boxed(response)
    return 0.0 if answer is None else exact_match(answer, label)


@register("dapo")
def dapo(response: str, label: str) -> float:
    """DAPO's rule: the text after the last 'Answer:' must equal the label; +1 / -1."""
    found = re.findall(r"Answer\s*:\s*([^\n]+)", response[-300:])
    return 1.0 if found and exact_match(found[-1], label) else -1.0


def get_reward(name: str) -> RewardFn:
    """A registered reward, or `package.module:function` for a user-supplied one."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(REWARDS)} or 'module:function'")
