"""The partial-rollout producer in a checkpoint (rollout.partial): groups cut by a weight update,
finished groups not yet batched, and batches made but not yet trained, so that a resumed run
continues them as the uninterrupted run would instead of starting new prompts.

The loop takes this state inside a weight update (`hold_engines`: the producer makes nothing
meanwhile, its round was cut and returned), together with the prompt cursor at that moment, which
the checkpoint stores as its data cursor: the pair is consistent, and no prompt is drawn twice or
skipped after a resume.

The file is plain JSON (ids, log-probs, versions, metrics, counters): loading it runs no code.
Python's json writes each float's shortest repr, so log-probs come back bit-exact. It lies in the
checkpoint directory, so the manifest's sha256 covers it and a torn or flipped file makes the
checkpoint incomplete; `read_pool_state` also validates the content in full before anything is
restored, so a wrong file (another format, another group size, inconsistent lengths) fails with a
clear error and nothing half-applied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miles_core.driver.schedules import RolloutBatch
from miles_core.types import Sample

POOL_FILE = "rollout_partial.json"
FORMAT = "miles.partial_pool"


class PartialStateError(ValueError):
    """A partial-pool file this run cannot continue from (not JSON, another format, another run
    shape, inconsistent samples). Never retried: the same file fails the same way."""


class SampleRecord(BaseModel):
    """One Sample as stored: every field but routed_experts (rollout.partial excludes routing
    replay, so it is always None here)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    label: str
    response_text: str
    rollout_logprobs: list[float]
    reward: float
    loss_mask: list[float]
    weight_version: str
    token_weight_versions: list[int]
    finish_reason: str
    filtered: bool
    max_new_tokens: int | None = Field(None, ge=1)
    """The prompt's own budget (Prompt.max_new_tokens): a restored cut sample stops where it would
    have. Absent in files written before per-prompt budgets: the recipe's."""

    @model_validator(mode="after")
    def _per_token_lists_match(self) -> SampleRecord:
        # Each per-token list is empty (not recorded) or one entry per response token: anything
        # else would misalign log-probs or versions with tokens in the trainer's batch.
        n = len(self.response_ids)
        for name in ("rollout_logprobs", "loss_mask", "token_weight_versions"):
            if len(getattr(self, name)) not in (0, n):
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} response tokens")
        return self


class BatchRecord(BaseModel):
    """A batch the producer made and the loop has not trained on yet."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    samples: list[SampleRecord] = Field(min_length=1)
    metrics: dict[str, float]
    version: int = Field(ge=0)
    cursor: dict[str, int]
    seconds: float


class PoolRecord(BaseModel):
    """The pool: its counters and groups, each group the n samples of one prompt."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    format: Literal["miles.partial_pool"]
    version: Literal[1]
    group_size: int = Field(ge=1)
    rounds: int = Field(ge=0)
    """Producer rounds run so far: the next round's seed depends on it."""
    tokens_thrown_away: int = Field(ge=0)
    groups_thrown_away: int = Field(ge=0)
    pending: list[list[SampleRecord]]
    done: list[list[SampleRecord]]
    batches: list[BatchRecord]
    """Made and not yet trained, oldest first: the loop trains them first after a resume."""

    @model_validator(mode="after")
    def _groups_are_whole(self) -> PoolRecord:
        for kind in ("pending", "done"):
            for i, group in enumerate(getattr(self, kind)):
                if len(group) != self.group_size:
                    raise ValueError(f"{kind} group {i} has {len(group)} samples, group_size is {self.group_size}")
                if len({s.prompt_index for s in group}) != 1:
                    raise ValueError(f"{kind} group {i} mixes prompts {sorted({s.prompt_index for s in group})}")
        return self


def sample_record(sample: Sample) -> dict:
    """A sample as plain data (a copy: the pool keeps mutating its samples)."""
    if sample.routed_experts is not None:
        raise ValueError("a partial-pool sample carries routed experts: rollout.partial excludes routing replay, "
                         "so this is a bug, not a configuration to checkpoint")
    return {name: (list(value) if isinstance(value := getattr(sample, name), list) else value)
            for name in SampleRecord.model_fields}


def record_sample(record: SampleRecord) -> Sample:
    return Sample(**{name: (list(value) if isinstance(value, list) else value)
                     for name, value in record.model_dump().items()})


def batch_record(batch: RolloutBatch) -> dict:
    return {"samples": [sample_record(s) for s in batch.samples], "metrics": dict(batch.metrics),
            "version": batch.version, "cursor": dict(batch.cursor), "seconds": batch.seconds}


def record_batch(record: BatchRecord) -> RolloutBatch:
    return RolloutBatch([record_sample(s) for s in record.samples], dict(record.metrics), record.version,
                        dict(record.cursor), record.seconds)


def pool_record(group_size: int, rounds: int, tokens_thrown_away: int, groups_thrown_away: int,
                pending: list[list[Sample]], done: list[list[Sample]], batches: list[RolloutBatch]) -> dict:
    """What PoolRecord validates, from a pool's fields and the batches not yet trained."""
    return {"format": FORMAT, "version": 1, "group_size": group_size, "rounds": rounds,
            "tokens_thrown_away": tokens_thrown_away, "groups_thrown_away": groups_thrown_away,
            "pending": [[sample_record(s) for s in g] for g in pending],
            "done": [[sample_record(s) for s in g] for g in done],
            "batches": [batch_record(b) for b in batches]}


def write_pool_state(directory: str | Path, state: dict) -> Path:
    """Write a pool's state_dict into a checkpoint's staging directory (the checkpoint's manifest
    and rename make it durable and atomic with the rest)."""
    path = Path(directory) / POOL_FILE
    path.write_text(json.dumps(state, separators=(",", ":")))
    return path


def read_pool_state(directory: str | Path, group_size: int) -> PoolRecord | None:
    """The validated pool of the checkpoint at directory, or None when it holds none (partial
    rollouts off, or written before pools were checkpointed). PartialStateError when the file is
    unreadable, of another format, or of another group size than group_size."""
    path = Path(directory) / POOL_FILE
    if not path.is_file():
        return None
    try:
        record = PoolRecord.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PartialStateError(f"{path}: not a JSON file ({exc}); the checkpoint's partial rollouts cannot be "
                                "continued: resume an earlier checkpoint, or delete the checkpoint") from None
    except ValidationError as exc:
        raise PartialStateError(f"{path}: not a partial-rollout pool this code can continue ({exc.error_count()} "
                                f"problems):\n{exc}") from None
    if record.group_size != group_size:
        raise PartialStateError(f"{path}: groups of {record.group_size} samples, but this run has "
                                f"rollout.num_samples_per_prompt={group_size}")
    return record
