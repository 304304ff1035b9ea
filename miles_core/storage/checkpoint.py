"""Run directories and checkpoints: a checkpoint is complete only once MANIFEST.json exists.

Layout under a run directory:
    checkpoints/step_000010/{model.safetensors, optimizer.safetensors, trainer_state.json, MANIFEST.json}
Writers fill `step_N.partial/`, write the manifest last, then rename; readers verify sizes
and sha256 and fall back to the previous checkpoint when one is corrupt.

Ownership: a run directory holds one run's files, named by its `RUN_KEY`; a new run refuses a
directory holding anything else (`check_run_dir`). A checkpoint's manifest records its run key
and the digest of the config that gives its state meaning (`RunIdentity`); a run resumes only
a checkpoint of its own key and config (`check_resumable`), where its config may differ only in
`RESUMABLE_CONFIG`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import miles_core

# A run key names directories (runs/<key>/ locally and in the store) and an MLflow tag filter:
# a path separator, `..` or a quote must never reach them.
RUN_KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_run_key(run_key: str) -> str:
    """The run key, or ValueError saying what a run key may contain."""
    if not RUN_KEY_PATTERN.fullmatch(run_key) or ".." in run_key:
        raise ValueError(f"invalid run key {run_key!r}: a run key is 1-128 letters, digits, '_', '-' or '.', "
                         "starts with a letter or digit and has no '..' (e.g. a flow run id printed by `miles run`)")
    return run_key

log = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"
RUN_KEY_FILE = "RUN_KEY"

# What a resume may change (dotted config paths, a section stands for all it holds): how long
# the run goes on (the README's `--resume KEY --set training.num_steps=200`), where and on how
# many processes it runs (checkpoints hold full tensors, so DP and TP may change), and how it is
# checkpointed, evaluated and tracked. The rest (seed, model, data, warm-up, algorithm, rollout
# sampling, optimizer) decides what a checkpoint's state means and must match.
RESUMABLE_CONFIG = (
    "training.num_steps", "training.data_parallel_size", "training.megatron.tensor_parallel_size",
    "training.num_threads", "training.cpus_per_trainer", "training.gpus_per_trainer",
    "rollout.num_engines", "rollout.cpus_per_engine", "rollout.gpus_per_engine", "rollout.weight_transport",
    "placement", "storage", "checkpoint", "eval", "tracking",
)


class CheckpointMismatchError(ValueError):
    """A checkpoint or run directory that belongs to another run, or to another config."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint whose loading could run code (a pickle beyond plain data, a bytes item that
    would be unpickled). Never retried: the same files fail the same way."""


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def git_commit() -> str | None:
    """The code's commit: $MILES_GIT_COMMIT (images bake it in), else `git rev-parse HEAD` of
    the checkout miles_core runs from, else None."""
    if os.environ.get("MILES_GIT_COMMIT"):
        return os.environ["MILES_GIT_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = done.stdout.strip() if done.returncode == 0 else ""
    return commit or None


def code_version() -> str:
    """Package version plus the (short) git commit when known."""
    commit = git_commit()
    return f"{miles_core.__version__}+{commit[:7]}" if commit else miles_core.__version__


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def resume_digest(config: dict[str, Any]) -> str:
    """sha256 (16 hex digits) of a resolved config (`RunConfig.model_dump(mode="json")`) without
    the fields in RESUMABLE_CONFIG."""
    kept = json.loads(json.dumps(config))
    for dotted in RESUMABLE_CONFIG:
        *parents, leaf = dotted.split(".")
        node = kept
        for name in parents:
            node = node.get(name) or {}
        node.pop(leaf, None)
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint shares with the run that may resume it. run_key None: a driver run
    outside a flow (tests, `python -m miles_core.train`), whose checkpoints have no key either."""

    run_key: str | None
    resume_digest: str

    @classmethod
    def of(cls, run_key: str | None, config) -> RunIdentity:
        return cls(run_key, resume_digest(config.model_dump(mode="json")))

    def describe(self) -> str:
        return f"run {self.run_key!r} (config digest {self.resume_digest})"


def build_manifest(directory: Path, step: int, config_digest: str, identity: RunIdentity | None = None) -> dict:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    owner = {} if identity is None else {"run_key": identity.run_key, "resume_digest": identity.resume_digest}
    return {
        "step": step,
        "config_digest": config_digest,
        **owner,
        "code_version": code_version(),
        "created_unix": time.time(),
        "files": {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                  for p in files},
    }


def write_checkpoint(checkpoints_dir: Path, step: int, config_digest: str,
                     write_files: Callable[[Path], None], identity: RunIdentity | None = None) -> Path:
    """Let write_files fill a staging dir, then seal it with a manifest (recording identity,
    the run that may resume it) and publish it."""
    final = checkpoints_dir / step_dir_name(step)
    staging = checkpoints_dir / (step_dir_name(step) + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_files(staging)
    manifest = build_manifest(staging, step, config_digest, identity)
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


def verify_checkpoint(directory: Path) -> str | None:
    """None when the checkpoint is complete and intact, else the reason it is not."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no MANIFEST.json (incomplete write)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return "MANIFEST.json is not valid JSON"
    for rel, meta in manifest["files"].items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{rel} has {path.stat().st_size} bytes, manifest says {meta['size']}"
        if sha256_file(path) != meta["sha256"]:
            return f"{rel} sha256 mismatch"
    return None


def check_resumable(directory: Path, identity: RunIdentity) -> None:
    """CheckpointMismatchError unless the (verified) checkpoint at directory was written by the
    run identity names, under a config that differs at most in RESUMABLE_CONFIG."""
    manifest = json.loads((directory / MANIFEST).read_text())
    if "resume_digest" not in manifest:
        # Written before manifests named their run: refusing it would strand every run started
        # before then. It lies in its run's own directory (RUN_KEY, checked when the run opened)
        # or under runs/<key>/ of the store, so only the config goes unchecked: said, not hidden.
        log.warning("checkpoint %s records no run key or config digest (written by an older version): resuming "
                    "it without comparing them to %s", directory, identity.describe())
        return
    recorded = RunIdentity(manifest.get("run_key"), manifest["resume_digest"])
    if recorded != identity:
        raise CheckpointMismatchError(
            f"checkpoint {directory} belongs to {recorded.describe()}, not to this {identity.describe()}: resuming "
            f"it would continue another run's state. A resume may change only {', '.join(RESUMABLE_CONFIG)}; "
            "resume with the run's own key and config (see its config.resolved.json), or start a new run in a new "
            "run directory")


def check_run_dir(run_dir: Path, run_key: str | None) -> None:
    """ValueError unless run_dir is new, empty, or this run's own (its RUN_KEY is run_key).
    run_key None: a new run whose key is not drawn yet, so only a new or empty directory."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise CheckpointMismatchError(f"run directory {run_dir} is a file: pass a new or empty directory")
    entries = sorted(p.name for p in run_dir.iterdir())
    if not entries:
        return
    key_file = run_dir / RUN_KEY_FILE
    owner = key_file.read_text().strip() if key_file.is_file() else None
    if owner is not None and owner == run_key:
        return
    if owner is None:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise CheckpointMismatchError(f"run directory {run_dir} is not empty ({shown}) and is no run's (no "
                                      f"{RUN_KEY_FILE}): a run would overwrite files there; pass a new or empty "
                                      "directory")
    this = "a new run" if run_key is None else f"run {run_key!r}"
    raise CheckpointMismatchError(
        f"run directory {run_dir} belongs to run {owner!r}, not to {this}: its checkpoints and summary.json "
        f"are that run's. To continue it pass --resume {owner} (Prefect: resume_from); for a new run pass a new "
        "or empty --run-dir")


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for path in checkpoints_dir.glob("step_*"):
        if path.is_dir() and path.name[5:].isdigit():
            found.append((int(path.name[5:]), path))
    return sorted(found)


def latest_complete_checkpoint(checkpoints_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint that verifies; corrupt ones are skipped with a warning."""
    for step, path in reversed(list_checkpoints(checkpoints_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return step, path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def discard_after(checkpoints_dir: Path, step: int) -> None:
    """Remove checkpoints and staging dirs newer than `step` (a dead attempt's leftovers)."""
    for other, path in list_checkpoints(checkpoints_dir):
        if other > step:
            shutil.rmtree(path, ignore_errors=True)
    for staging in checkpoints_dir.glob("*.partial"):
        shutil.rmtree(staging, ignore_errors=True)


def prune(checkpoints_dir: Path, keep_latest: int) -> None:
    complete = [(s, p) for s, p in list_checkpoints(checkpoints_dir) if (p / MANIFEST).is_file()]
    for _, path in complete[:-keep_latest]:
        shutil.rmtree(path, ignore_errors=True)
