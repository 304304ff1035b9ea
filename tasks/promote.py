"""Promotion behind the eval gate, inside a Prefect transaction.

`promote` (called from a flow) moves the `champion` alias and then tags the versions. If
tagging fails, the transaction rolls back and `set_champion_alias`'s rollback hook puts the
previous champion back, so the registry never shows a champion whose promotion is unrecorded.

Neither task has Prefect retries or a cache key, on purpose (both checked against
prefect 3.9.1's transactions.py / task_engine.py):
- a failed attempt of a task inside a transaction rolls the enclosing transaction back at
  once (Transaction.__exit__ -> reset -> parent.rollback), so a retry that later succeeds
  would leave the alias restored while the tags say "champion";
- with a cache key, a rerun with the same inputs finds its record committed and skips the
  task (and its rollback hook). With NO_CACHE the task's transaction has no key and stores
  nothing, yet its rollback hook is still staged into the enclosing transaction.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import Transaction, get_transaction, transaction

from miles_core.tracking import registry
from miles_core.tracking.registry import GateDecision, record_decision


class PromotionRolledBack(RuntimeError):
    """The promotion transaction was rolled back; the previous champion is still in place."""


@task(name="set-champion-alias", cache_policy=NO_CACHE)
def set_champion_alias(uri: str, name: str, version: str) -> str | None:
    """Move `champion` to version; returns (and records for the rollback) the previous one."""
    previous, _ = registry.champion(uri, name)
    txn = get_transaction()
    # Recorded before the move: the rollback hook reads only what the transaction holds.
    for key, value in {"uri": uri, "name": name, "version": version, "previous_champion": previous}.items():
        txn.set(key, value)
    try:
        registry.set_champion(uri, name, version)
    except Exception:
        # The rollback hook is registered only for tasks that complete; if the move failed
        # after the server applied it (e.g. a lost response), undo it here.
        registry.set_champion(uri, name, previous)
        raise
    get_run_logger().info("champion of %s: v%s -> v%s", name, previous, version)
    return previous


@set_champion_alias.on_rollback
def _restore_previous_champion(txn: Transaction) -> None:
    uri, name, version = txn.get("uri"), txn.get("name"), txn.get("version")
    previous = txn.get("previous_champion")
    registry.set_champion(uri, name, previous)  # None deletes the alias: there was no champion
    registry.undo_decision_tags(uri, name, version, previous,
                                f"promotion rolled back; champion restored to v{previous}")


@task(name="record-promotion", cache_policy=NO_CACHE)
def record_promotion(uri: str, name: str, version: str, decision: dict) -> None:
    """Tag the versions: promotion, promotion_reason, and superseded_by on the old champion."""
    record_decision(uri, name, version, GateDecision(**decision))


def promote(uri: str, name: str, version: str, min_score: float, min_improvement: float) -> dict:
    """Gate, then (if it passes) alias move + tags as one transaction. Call inside a flow.

    Returns the decision as a dict plus `promoted`, `version` and `champion` (the version that
    holds the alias afterwards). Raises PromotionRolledBack (the cause chained) on rollback.
    """
    version = str(version)
    decision = registry.decide(uri, name, version, min_score, min_improvement)
    outcome = {**decision.as_dict(), "version": version}
    log = get_run_logger()
    if not decision.promote:
        if decision.champion_version != version:  # re-promoting the champion must not mark it rejected
            record_decision(uri, name, version, decision)
        log.info("%s v%s stays candidate: %s", name, version, decision.reason)
        return {**outcome, "promoted": False, "champion": decision.champion_version}
    try:
        with transaction() as txn:
            set_champion_alias(uri, name, version)
            record_promotion(uri, name, version, decision.as_dict())
    except Exception as exc:  # the transaction has already run the rollback hooks
        raise PromotionRolledBack(f"promotion of {name} v{version} failed and was rolled back "
                                  f"(champion stays v{decision.champion_version}): {exc!r}") from exc
    if txn.is_rolled_back():  # e.g. a commit hook failed: never report success then
        raise PromotionRolledBack(f"promotion of {name} v{version} was rolled back")
    log.info("%s v%s is champion: %s", name, version, decision.reason)
    return {**outcome, "promoted": True, "champion": version}
