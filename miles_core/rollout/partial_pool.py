"""The fully async producer's groups with rollout.partial: partial samples kept across updates.

Each round runs at the engines' current weights: groups too stale are thrown away, the partial
samples of the others are continued (re-prefill, see miles_core.rollout.partial), and new prompts
start. A round ends early when the schedule pauses the engines for a weight update (their running
requests come back with finish_reason abort and what they have); the next round continues them
with the new weights. A group trains once all its samples are done, in the order groups finished.
The pool's state (groups and counters) goes into checkpoints: see miles_core.rollout.partial_state.
"""

from __future__ import annotations

from miles_core.driver.schedules import RolloutBatch
from miles_core.metrics import PARTIAL_TOKENS_THROWN_AWAY
from miles_core.rollout.manager import RolloutManager
from miles_core.rollout.partial import is_partial, version_metrics
from miles_core.rollout.partial_state import PartialStateError, PoolRecord, pool_record, record_sample
from miles_core.types import Prompt, Sample, token_versions


class PartialPool:
    """Groups in flight across weight updates, and the finished ones waiting to train."""

    def __init__(self, manager: RolloutManager, group_size: int, max_staleness_versions: int):
        self.manager, self.group_size, self.max_staleness = manager, group_size, max_staleness_versions
        self.pending: list[list[Sample]] = []
        self.done: list[list[Sample]] = []
        self.tokens_thrown_away = 0
        self.groups_thrown_away = 0
        self.rounds = 0
        """Rounds run so far (the producer derives each round's seed from it)."""

    def round(self, prompts: list[Prompt], version: int, seed: int) -> None:
        """One round at engine weights `version`: stale groups out, partial samples continued,
        `prompts` started (num_samples_per_prompt each); groups sorted into done and pending."""
        self.rounds += 1
        self._drop_stale(version)
        groups, self.pending = self.pending, []
        if groups:
            self.manager.continue_partial([s for g in groups for s in g], seed)
        if prompts:
            samples = self.manager.generate(prompts, seed + 1)
            groups += [samples[i : i + self.group_size] for i in range(0, len(samples), self.group_size)]
        for group in groups:
            (self.pending if any(is_partial(s) for s in group) else self.done).append(group)

    def take(self, num_groups: int) -> list[Sample] | None:
        """The first num_groups finished groups (flattened), or None while fewer are done."""
        if len(self.done) < num_groups:
            return None
        taken, self.done = self.done[:num_groups], self.done[num_groups:]
        return [s for g in taken for s in g]

    def prompts_wanted(self, num_groups: int) -> int:
        """New prompts that keep num_groups groups done or in flight."""
        return max(0, num_groups - len(self.done) - len(self.pending))

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """Per batch: tokens per weight version and mixed-version share (version_metrics), and
        what staleness threw away so far."""
        return version_metrics(samples) | {
            PARTIAL_TOKENS_THROWN_AWAY: float(self.tokens_thrown_away),
            "rollout/partial_groups_thrown_away": float(self.groups_thrown_away),
            "rollout/partial_pending_groups": float(len(self.pending))}

    def state_dict(self, batches: list[RolloutBatch] = ()) -> dict:
        """The pool and the batches made from it and not yet trained, as plain data (a copy: later
        rounds do not change it), for a checkpoint. Taken while no round runs."""
        return pool_record(self.group_size, self.rounds, self.tokens_thrown_away, self.groups_thrown_away,
                           self.pending, self.done, list(batches))

    def restore(self, record: PoolRecord) -> None:
        """Take a checkpoint's pool (validated by read_pool_state, so this cannot fail half-way);
        its batches go to the schedule (FullyAsyncSchedule.restore). Stale groups are dropped by
        the next round, counted as usual."""
        if record.group_size != self.group_size:
            raise PartialStateError(f"pool of groups of {record.group_size}, this pool's are of {self.group_size}")
        self.pending = [[record_sample(s) for s in g] for g in record.pending]
        self.done = [[record_sample(s) for s in g] for g in record.done]
        self.rounds, self.tokens_thrown_away = record.rounds, record.tokens_thrown_away
        self.groups_thrown_away = record.groups_thrown_away

    def _drop_stale(self, version: int) -> None:
        kept = []
        for group in self.pending:
            versions = [v for s in group for v in token_versions(s)]
            if versions and version - min(versions) > self.max_staleness:
                self.tokens_thrown_away += len(versions)
                self.groups_thrown_away += 1
            else:
                kept.append(group)
        self.pending = kept
