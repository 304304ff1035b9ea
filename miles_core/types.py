"""The data a run passes between its parts: a tokenised prompt (`Prompt`), a generated response
(`Sample`) and the weight versions its tokens came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prompt:
    """One dataset row, tokenised: what a rollout group starts from."""

    index: int
    messages: list[dict[str, str]] | str
    label: str
    input_ids: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None
    """This prompt's own generation budget, overriding rollout.max_new_tokens (None: the
    recipe's). Read from the row key data.max_new_tokens_key; every sample of the prompt, and
    every continuation of a partial one, generates within it."""

    def __post_init__(self) -> None:
        check_max_new_tokens(self.max_new_tokens, f"prompt {self.index}")


@dataclass
class Sample:
    """One generated response: the unit the trainer learns from."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    label: str
    response_text: str = ""
    rollout_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    loss_mask: list[float] = field(default_factory=list)
    """Per response token 1/0 (empty = train on every response token); multi-turn SFT masks."""
    weight_version: str = "0"
    """The engine's weight version when the response finished (kept for compatibility; with
    partial rollouts a response can span several: see token_weight_versions)."""
    token_weight_versions: list[int] = field(default_factory=list)
    """Per response token, the weight version that generated it (a sample paused and continued
    across weight updates mixes versions). Empty: every token at `weight_version` (SFT, custom
    generate functions that do not set it); see token_versions()."""
    finish_reason: str = "stop"
    filtered: bool = False
    """Dropped by rollout.sample_filter: it keeps its place in its group and trains on no token."""
    routed_experts: Any = None
    """MoE routing replay: the experts the engine routed each token to, an int32 array
    [len(prompt_ids) + len(response_ids) - 1, num_layers, top_k] (SGLang's layout; its flat
    buffer arrives as [..., num_layers * top_k] and the trainer, which knows the model,
    reshapes). None when the engine was not asked for them."""
    max_new_tokens: int | None = None
    """Its prompt's own budget (Prompt.max_new_tokens), kept so that a partial sample continued
    after a weight update stops where the uncut one would have. None: rollout.max_new_tokens."""

    def __post_init__(self) -> None:
        check_max_new_tokens(self.max_new_tokens, f"sample of prompt {self.prompt_index}")


def check_max_new_tokens(value: Any, where: str) -> None:
    """A per-prompt budget is None or an int >= 1 (a bool or a float from a JSON row is refused:
    silently truncating 12.7 or taking True as 1 would hide a broken dataset)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise ValueError(f"{where}: max_new_tokens must be an integer >= 1 or absent, got {value!r}; fix the "
                     "dataset's per-prompt budget (data.max_new_tokens_key) or drop it to use rollout.max_new_tokens")


def version_number(version: str | int) -> int:
    """A weight version as an int: SGLang's "default" (no update yet) is version 0."""
    text = str(version)
    return int(text) if text.lstrip("-").isdigit() else 0


def token_versions(sample: Sample) -> list[int]:
    """The weight version of each response token (token_weight_versions, or weight_version for all)."""
    if sample.token_weight_versions:
        return list(sample.token_weight_versions)
    return [version_number(sample.weight_version)] * len(sample.response_ids)


def is_mixed_version(sample: Sample) -> bool:
    """True when the sample's response tokens come from more than one weight version."""
    return len(set(token_versions(sample))) > 1
