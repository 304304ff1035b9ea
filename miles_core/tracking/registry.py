"""Model registry promotion: `candidate` -> `champion` only through an eval gate.

The Prefect side (a transaction that undoes a half-done promotion) lives in tasks/promote.py;
this module is the plain MLflow logic: the gate, alias moves, tags, and downloads.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException

from miles_core.config.training import TrainingConfig
from miles_core.metrics import AFTER_HELDOUT_PASS_AT_1
from miles_core.tracking.runs import client_for
from miles_core.types import LORA_ADAPTER_DIR

SCORE_TAG = "eval_pass_at_1"
"""The model version tag the gate compares (a registry tag, not a metric: its name is unchanged)."""
SCORE_METRIC = AFTER_HELDOUT_PASS_AT_1
"""The run metric the score tag copies: the canonical name, never a deprecated alias."""
CHAMPION = "champion"
WEIGHTS_TAG = "weights"
"""What a model version's weights are: "full" (every weight trained) or "merged_lora" (training.lora:
the adapters merged into the base; the adapters alone under LORA_ADAPTER_DIR)."""


def score_tag(after_metrics: dict[str, float]) -> dict[str, str]:
    """{SCORE_TAG: score} for a new model version, from the metrics log_eval_metrics logged after
    training (a KeyError names SCORE_METRIC when the held-out set was not evaluated)."""
    return {SCORE_TAG: str(after_metrics[SCORE_METRIC])}


def weights_tags(training: TrainingConfig) -> dict[str, str]:
    """The tags saying what a new model version's weights are (training.lora or not)."""
    if not training.lora_enabled:
        return {WEIGHTS_TAG: "full"}
    lora = training.lora
    return {WEIGHTS_TAG: "merged_lora", "lora_adapter_dir": LORA_ADAPTER_DIR, "lora_rank": str(lora.rank),
            "lora_alpha": str(lora.alpha), "lora_target_modules": ",".join(lora.modules)}


@dataclass
class GateDecision:
    promote: bool
    reason: str
    candidate_score: float
    champion_version: str | None
    champion_score: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def _score(tags: dict[str, str], what: str) -> float:
    raw = tags.get(SCORE_TAG)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{what} has no numeric {SCORE_TAG!r} tag (got {raw!r}); register it with "
                         f"tags={{'{SCORE_TAG}': str(pass_at_1)}}") from None
    if math.isnan(value):
        raise ValueError(f"{what}: {SCORE_TAG} is NaN")
    return value


def champion(uri: str, name: str) -> tuple[str | None, float | None]:
    """(version, score) of the current champion, or (None, None) when there is none.

    A champion without a usable score tag gets score None: the gate then requires only the floor.
    """
    try:
        version = client_for(uri).get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None, None
    try:
        return str(version.version), _score(version.tags, f"champion {name} v{version.version}")
    except ValueError:
        return str(version.version), None


def decide(uri: str, name: str, version: str, min_score: float, min_improvement: float) -> GateDecision:
    """The gate: an absolute floor, and a margin over the current champion."""
    score = _score(client_for(uri).get_model_version(name, version).tags, f"{name} v{version}")
    champ_version, champ_score = champion(uri, name)
    if champ_version == str(version):
        return GateDecision(False, f"v{version} is already the champion", score, champ_version, champ_score)
    if score < min_score:
        reason = f"score {score:.4f} below the floor {min_score:.4f}"
        return GateDecision(False, reason, score, champ_version, champ_score)
    if champ_score is not None and score < champ_score + min_improvement:
        reason = (f"score {score:.4f} does not beat champion v{champ_version} ({champ_score:.4f}) "
                  f"by {min_improvement:.4f}")
        return GateDecision(False, reason, score, champ_version, champ_score)
    if champ_version is None:
        beaten = "no champion yet"
    elif champ_score is None:
        beaten = f"champion v{champ_version} has no score"
    else:
        beaten = f"champion v{champ_version} ({champ_score:.4f})"
    return GateDecision(True, f"score {score:.4f} passes the gate; {beaten}", score, champ_version, champ_score)


def set_champion(uri: str, name: str, version: str | None) -> None:
    """Point `champion` at version; None removes the alias."""
    client = client_for(uri)
    if version is None:
        try:
            client.delete_registered_model_alias(name, CHAMPION)
        except MlflowException:  # already absent: the desired end state
            pass
    else:
        client.set_registered_model_alias(name, CHAMPION, str(version))


def record_decision(uri: str, name: str, version: str, decision: GateDecision) -> None:
    """Tag the candidate with the outcome, and the champion it replaces with superseded_by."""
    client = client_for(uri)
    client.set_model_version_tag(name, version, "promotion", CHAMPION if decision.promote else "rejected")
    client.set_model_version_tag(name, version, "promotion_reason", decision.reason)
    if decision.promote and decision.champion_version:
        client.set_model_version_tag(name, decision.champion_version, "superseded_by", str(version))


def undo_decision_tags(uri: str, name: str, version: str, previous_champion: str | None, why: str) -> None:
    """After a rollback: the candidate is marked rolled_back, the old champion not superseded."""
    client = client_for(uri)
    client.set_model_version_tag(name, version, "promotion", "rolled_back")
    client.set_model_version_tag(name, version, "promotion_reason", why)
    if previous_champion:
        tags = client.get_model_version(name, previous_champion).tags
        if tags.get("superseded_by") == str(version):
            client.delete_model_version_tag(name, previous_champion, "superseded_by")


_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))/?$")


def resolve_model_uri(uri: str, model_uri: str) -> tuple[str, str]:
    """`models:/name@alias` or `models:/name/version` -> (name, version), via this tracking URI."""
    match = _MODELS_URI.match(model_uri)
    if not match:
        raise ValueError(f"{model_uri!r} is not models:/<name>@<alias> or models:/<name>/<version>")
    name = match["name"]
    if match["version"]:
        return name, match["version"]
    try:
        return name, str(client_for(uri).get_model_version_by_alias(name, match["alias"]).version)
    except MlflowException as exc:
        raise LookupError(f"{model_uri}: no such model/alias in the registry at {uri} ({exc.message})") from None


def _hf_root(path: Path) -> Path:
    """The directory holding config.json: the download itself, or the shallowest one below it."""
    if (path / "config.json").is_file():
        return path
    found = [p.parent for p in path.rglob("config.json")]
    if not found:
        raise FileNotFoundError(f"downloaded model at {path} has no config.json (not an HF export)")
    return min(found, key=lambda p: len(p.parts))


def download_model(uri: str, model_uri: str, dest_dir: str | Path) -> Path:
    """Download a registered version (`models:/name@alias` or `models:/name/version`) as an HF dir
    under dest_dir/<name>-v<version>/.

    mlflow's own `models:/` resolution looks names up in the process-global registry URI, not
    the one passed in, so the version is resolved here and its source downloaded directly.
    A non-MLmodel source like ours comes back as <dest>/<last path part> (here step_NNNNNN).
    """
    import mlflow

    name, version = resolve_model_uri(uri, model_uri)
    source = client_for(uri).get_model_version_download_uri(name, version)
    dest = Path(dest_dir) / f"{name}-v{version}"
    shutil.rmtree(dest, ignore_errors=True)  # ours alone: a stale partial download must not mix in
    dest.mkdir(parents=True)
    local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dest), tracking_uri=uri)
    return _hf_root(Path(local))


def load_champion(uri: str, name: str, dest_dir: str | Path) -> Path:
    """Download `models:/<name>@champion`; returns a directory from_pretrained loads."""
    return download_model(uri, f"models:/{name}@{CHAMPION}", dest_dir)
