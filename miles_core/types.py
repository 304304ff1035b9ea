"""The data a run passes between its parts: a tokenised prompt (`Prompt`), a generated response
(`Sample`), the weight versions its tokens came from, and one dataset's evaluation (`EvalResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

LORA_ADAPTER_DIR = "adapter"
"""The folder of a LoRA run's HF export (and so of its registered model) that holds the adapters
alone, in PEFT's layout; the export's own weights are the merged ones."""


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


_COUNT_KEYS = {"num_prompts": "num_prompts", "num_samples": "num_samples_per_prompt"}
"""JSON key -> EvalResult field of the counts (the JSON names are the files' schema)."""


class EvalResult(BaseModel):
    """One dataset's evaluation: what evaluation produces and reports, flows, the registry tag
    and MLflow logging consume. Its JSON form (`to_json`, read back by `from_json`) is the schema
    eval files and summary.json have always had: {"pass@1": .., "pass@k": .., "avg@n": ..,
    "num_prompts": .., "num_samples": .., "examples": [..]}, plus an external command's keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pass_at_k: dict[int, float]
    """Fraction of prompts (0 to 1) with a correct response (reward > 0) among k of the n samples,
    by k (the unbiased estimator; only k <= n). Always holds k=1."""
    mean_reward_at_n: dict[int, float] = Field(default_factory=dict)
    """avg@n: mean reward (the reward function's units) over all n samples of every prompt, by n.
    Equals pass@1 for 0/1 rewards, not for +-1 rewards like dapo's."""
    num_prompts: int | None = None
    """Prompts scored (None where the evaluator did not say, e.g. an external command)."""
    num_samples_per_prompt: int | None = None
    """n: responses sampled per prompt (None where the evaluator did not say)."""
    examples: list[dict[str, Any]] = Field(default_factory=list)
    """A few scored rows: {prompt, label, responses, rewards}, or {prompt, label, response,
    correct} from the greedy evaluator."""
    other_metrics: dict[str, float] = Field(default_factory=dict)
    """Numeric "pass@..."/"avg@..." keys of an external command whose suffix is not a count
    (e.g. "pass@1_strict"): reported and logged like the others, sorted after them."""
    other: dict[str, Any] = Field(default_factory=dict)
    """Anything else an external command wrote: kept in the JSON, never logged as metrics."""

    @property
    def pass_at_1(self) -> float:
        """Fraction of prompts (0 to 1) answered correctly by one sample: the score gates compare."""
        return self.pass_at_k[1]

    def metrics(self) -> dict[str, float]:
        """{"pass@k": .., "avg@n": ..}: the metric names reports and MLflow keys are built from."""
        return ({f"pass@{k}": v for k, v in sorted(self.pass_at_k.items())}
                | {f"avg@{n}": v for n, v in sorted(self.mean_reward_at_n.items())} | self.other_metrics)

    def to_json(self, examples: bool = True) -> dict[str, Any]:
        """The file schema; examples=False for summaries (counts and metrics only)."""
        counts = {key: getattr(self, name) for key, name in _COUNT_KEYS.items() if getattr(self, name) is not None}
        return self.metrics() | counts | self.other | ({"examples": self.examples} if examples else {})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvalResult:
        """Parse the file schema (what evaluators and external commands write); needs a numeric pass@1."""
        pass_at_k, avg_at_n, other_metrics, counts, other = {}, {}, {}, {}, {}
        for key, value in data.items():
            kind, _, k = key.partition("@")
            if kind in ("pass", "avg") and _is_number(value):
                table = other_metrics if not k.isdigit() else pass_at_k if kind == "pass" else avg_at_n
                table[int(k) if k.isdigit() else key] = float(value)
            elif key in _COUNT_KEYS and isinstance(value, int) and not isinstance(value, bool):
                counts[_COUNT_KEYS[key]] = value
            elif key != "examples":
                other[key] = value
        if 1 not in pass_at_k:
            raise ValueError(f"an eval result needs a numeric 'pass@1'; got {str(data)[:200]!r}")
        return cls(pass_at_k=pass_at_k, mean_reward_at_n=avg_at_n, other_metrics=other_metrics,
                   examples=list(data.get("examples", [])), other=other, **counts)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
