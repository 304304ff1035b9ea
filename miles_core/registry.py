"""Model registry promotion: `candidate` -> `champion` only through an eval gate."""

from __future__ import annotations

from dataclasses import dataclass

from mlflow.exceptions import MlflowException

from miles_core.tracking import client_for

SCORE_TAG = "eval_pass_at_1"


@dataclass
class GateDecision:
    promote: bool
    reason: str
    candidate_score: float
    champion_version: str | None
    champion_score: float | None


def champion(uri: str, name: str) -> tuple[str | None, float | None]:
    """(version, score) of the current champion, or (None, None) when there is none."""
    try:
        version = client_for(uri).get_model_version_by_alias(name, "champion")
    except MlflowException:
        return None, None
    return str(version.version), float(version.tags.get(SCORE_TAG, "nan"))


def decide(uri: str, name: str, version: str, min_score: float, min_improvement: float) -> GateDecision:
    """The gate: an absolute floor, and a margin over the current champion."""
    score = float(client_for(uri).get_model_version(name, version).tags[SCORE_TAG])
    champ_version, champ_score = champion(uri, name)
    if score < min_score:
        return GateDecision(False, f"score {score:.4f} below the floor {min_score:.4f}", score, champ_version, champ_score)
    if champ_version is not None and score < champ_score + min_improvement:
        reason = (f"score {score:.4f} does not beat champion v{champ_version} ({champ_score:.4f}) "
                  f"by {min_improvement:.4f}")
        return GateDecision(False, reason, score, champ_version, champ_score)
    beaten = f"champion v{champ_version} ({champ_score:.4f})" if champ_version else "no champion yet"
    return GateDecision(True, f"score {score:.4f} passes the gate; {beaten}", score, champ_version, champ_score)


def set_champion(uri: str, name: str, version: str | None) -> None:
    client = client_for(uri)
    if version is None:
        client.delete_registered_model_alias(name, "champion")
    else:
        client.set_registered_model_alias(name, "champion", version)


def record_decision(uri: str, name: str, version: str, decision: GateDecision) -> None:
    client = client_for(uri)
    client.set_model_version_tag(name, version, "promotion", "champion" if decision.promote else "rejected")
    client.set_model_version_tag(name, version, "promotion_reason", decision.reason)
    if decision.promote and decision.champion_version:
        client.set_model_version_tag(name, decision.champion_version, "superseded_by", version)
