"""Reward functions: an explicit registry of `name -> fn(response_text, label) -> float`."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from miles_core.plugins import SIGNATURES, load_plugin

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


# ---- math equivalence (Hugging Face math-verify) ---------------------------------------------
MATH_TAIL_CHARS = 2000
"""Only the end of a response is parsed: final answers sit there, and parsing cost grows with length."""


# math-verify's timeouts are SIGALRM-based and refuse to run outside the main thread, where
# rollouts are scored (async loops score in a producer thread): they are turned off.
@functools.lru_cache(maxsize=4096)
def _parse_gold(label: str) -> tuple:
    """The parsed label, once per label (a group's n samples share it)."""
    from math_verify import parse

    return tuple(parse(label if ("$" in label or "\\boxed" in label) else f"${label}$", parsing_timeout=None))


def _verify(label: str, answer_text: str) -> bool:
    from math_verify import parse, verify

    gold = list(_parse_gold(label))
    answer = parse(answer_text[-MATH_TAIL_CHARS:], parsing_timeout=None)
    return bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)


@register("math")
def math_equivalent(response: str, label: str) -> float:
    """1.0 when the response's final answer (\\boxed{}, `$...$`, "Answer: ..." or the last
    expression) is mathematically equal to the label: 1/2 = 0.5 = \\frac{1}{2}, 1,000 = 1000."""
    return float(_verify(label, response))


@register("math_boxed")
def math_boxed(response: str, label: str) -> float:
    """1.0 when the last \\boxed{} answer is mathematically equal to the label (math-verify);
    a response without a box scores 0."""
    answer = last_boxed(response)
    return 0.0 if answer is None else float(_verify(label, f"\\boxed{{{answer}}}"))


# ---- DAPO (DAPO-Math-17k's rule, with its own answer normalisation) ---------------------------
DAPO_TAIL_CHARS = 300
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# DAPO normalises both sides by the Minerva rules before comparing strings: these are those
# rules' replacement tables, applied in this order.
_DAPO_REPLACE = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_DAPO_DROP = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
]
_DAPO_PATTERNS = [
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # the first $...$ only
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
]


def dapo_normalize(answer: str) -> str:
    """DAPO's final-answer normalisation: the part after the last '=', units and LaTeX
    spacing removed, $...$ / \\text{} / \\boxed{} unwrapped, thousands commas dropped."""
    answer = answer.split("=")[-1]
    for old, new in _DAPO_REPLACE:
        answer = answer.replace(old, new)
    for expression in _DAPO_DROP:
        answer = answer.replace(expression, "")
    for pattern, replacement in _DAPO_PATTERNS:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


@register("dapo")
def dapo(response: str, label: str) -> float:
    """DAPO's rule: the last 'Answer: ...' line within the response's final 300 characters,
    normalised as DAPO does, must equal the normalised label; +1 / -1."""
    found = _DAPO_ANSWER.findall(response[-DAPO_TAIL_CHARS:])
    return 1.0 if found and dapo_normalize(found[-1]) == dapo_normalize(label) else -1.0


def get_reward(name: str, field: str = "rollout.reward") -> RewardFn:
    """A registered reward, or `package.module:function` for a user-supplied one (checked to take
    (response, label)); errors name `field`."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        return load_plugin(name, field, SIGNATURES["rollout.reward"])
    raise ValueError(f"{field}: unknown reward {name!r}; registered: {sorted(REWARDS)} or 'module:function'")
