"""Run directories and checkpoints: a checkpoint is complete only once MANIFEST.json exists.

Layout under a run directory:
    checkpoints/step_000010/{model.safetensors, optimizer.safetensors, trainer_state.json, MANIFEST.json}
Writers fill `step_N.partial/`, write the manifest last, then rename; readers verify sizes
and sha256 and fall back to the previous checkpoint when one is corrupt.
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
from pathlib import Path

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


def build_manifest(directory: Path, step: int, config_digest: str) -> dict:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {
        "step": step,
        "config_digest": config_digest,
        "code_version": code_version(),
        "created_unix": time.time(),
        "files": {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                  for p in files},
    }


def write_checkpoint(checkpoints_dir: Path, step: int, config_digest: str,
                     write_files: Callable[[Path], None]) -> Path:
    """Let write_files fill a staging dir, then seal it with a manifest and publish it."""
    final = checkpoints_dir / step_dir_name(step)
    staging = checkpoints_dir / (step_dir_name(step) + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_files(staging)
    manifest = build_manifest(staging, step, config_digest)
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
