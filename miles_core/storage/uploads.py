"""Checkpoints to the object store: uploaded in the background, retried, verified, pointer last.

Store layout of a run:
    <store>/runs/<run_key>/checkpoints/step_000020/{model.safetensors, ..., MANIFEST.json}
    <store>/runs/<run_key>/checkpoints/latest.json   {step, uri, manifest_sha256, time_unix}

latest.json is the only thing readers trust. It is written (atomically) only after every
file of the checkpoint it names was uploaded and read back with the right size and sha256,
it never moves backwards, and pruning never deletes what it points to. So a failed or
interrupted upload leaves it at the previous good checkpoint.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict

from miles_core.config import CheckpointConfig
from miles_core.errors import InfrastructureError
from miles_core.storage import checkpoint as ckpt
from miles_core.storage import object_store as storage

log = logging.getLogger(__name__)
T = TypeVar("T")
LATEST = "latest.json"
MAX_BACKOFF_SECONDS = 60.0

# Retry only what a retry can fix: network errors, timeouts, 5xx, a read-back mismatch.
# Access denied, a missing bucket or local file, or missing credentials fail at once.
PERMANENT_OS_ERRORS = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
PERMANENT_ERROR_NAMES = {"NoCredentialsError", "PartialCredentialsError", "ParamValidationError"}
TRANSIENT_ERROR_NAMES = {"BotoCoreError", "ClientError", "ClientPayloadError", "ServerDisconnectedError",
                         "ClientOSError"}


class UploadFailed(IOError):
    """A checkpoint could not be uploaded or restored; the message says which and why."""


class StoreUnavailable(UploadFailed, InfrastructureError):
    """The store kept failing (errors, timeouts) through every attempt; a later retry may succeed."""


@dataclass
class UploadStats:
    """Totals of one uploader (or one synchronous upload), for logs and the task result."""

    checkpoints: list[int] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    failures: list[str] = field(default_factory=list)

    def megabytes_per_second(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def is_transient(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    if isinstance(exc, PERMANENT_OS_ERRORS) or names & PERMANENT_ERROR_NAMES:
        return False
    return isinstance(exc, (OSError, TimeoutError, asyncio.TimeoutError)) or bool(names & TRANSIENT_ERROR_NAMES)


def with_retries(what: str, fn: Callable[[], T], cfg: CheckpointConfig, stats: UploadStats,
                 stop: threading.Event | None = None) -> T:
    """fn() with up to cfg.upload_attempts attempts, exponential backoff and jitter between them;
    setting `stop` aborts the wait between attempts."""
    stop = stop or threading.Event()
    for attempt in range(1, cfg.upload_attempts + 1):
        try:
            return fn()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if not is_transient(exc):
                raise UploadFailed(f"{what}: {error} (not retried: a retry cannot fix this)") from exc
            if attempt == cfg.upload_attempts:
                raise StoreUnavailable(f"{what}: still failing after {attempt} attempts: {error}") from exc
            # Jitter spreads the retries of many writers; the cap keeps a long outage polled.
            delay = min(MAX_BACKOFF_SECONDS, cfg.upload_backoff_seconds * 2 ** (attempt - 1))
            delay *= random.uniform(0.5, 1.0)
            stats.retries += 1
            log.warning("%s failed (attempt %d/%d): %s; retrying in %.2f s", what, attempt,
                        cfg.upload_attempts, error, delay)
            if stop.wait(delay):
                raise UploadFailed(f"{what}: the uploader was closed while retrying") from exc
    raise AssertionError("unreachable")


def checkpoints_uri(store_uri: str, run_key: str) -> str:
    return storage.join_uri(store_uri, "runs", run_key, "checkpoints")


def read_latest(store_uri: str, run_key: str, cfg: CheckpointConfig, stats: UploadStats | None = None) -> dict | None:
    """The run's latest.json in the store, or None when nothing was uploaded yet."""
    fs, root = storage.filesystem(checkpoints_uri(store_uri, run_key), cfg.upload_timeout_seconds)
    return with_retries(f"read {LATEST}", lambda: storage.read_json(fs, f"{root}/{LATEST}"), cfg,
                        stats or UploadStats())


def upload_checkpoint(store_uri: str, run_key: str, step: int, local_dir: Path, cfg: CheckpointConfig,
                      stats: UploadStats | None = None, stop: threading.Event | None = None) -> tuple[dict, bool]:
    """Upload one complete local checkpoint, verify every file, move latest.json to it, prune.

    Returns (latest pointer, whether anything was uploaded): a step the store already has
    (latest.json at this step or newer, e.g. a retried task) is not uploaded again, and a
    checkpoint latest.json points to is never overwritten in place."""
    stats = stats if stats is not None else UploadStats()
    base_uri = checkpoints_uri(store_uri, run_key)
    fs, root = storage.filesystem(base_uri, cfg.upload_timeout_seconds)
    latest = with_retries(f"step {step}: read {LATEST}", lambda: storage.read_json(fs, f"{root}/{LATEST}"),
                          cfg, stats, stop)
    if latest is not None and latest["step"] >= step:
        log.info("store already has step %d (latest.json); not uploading step %d", latest["step"], step)
        return latest, False
    manifest = json.loads((local_dir / ckpt.MANIFEST).read_text())
    dest_uri = storage.join_uri(base_uri, ckpt.step_dir_name(step))
    dest = f"{root}/{ckpt.step_dir_name(step)}"
    started, sent_bytes = time.perf_counter(), 0
    retries_before = stats.retries
    for rel in [*sorted(manifest["files"]), ckpt.MANIFEST]:  # manifest last: its presence means complete
        meta = with_retries(f"upload {rel} of step {step}", lambda rel=rel: storage.upload_file(
            fs, local_dir / rel, f"{dest}/{rel}", cfg.upload_part_megabytes << 20), cfg, stats, stop)
        expected = manifest["files"].get(rel)
        if expected is not None and expected["sha256"] != meta["sha256"]:
            raise UploadFailed(f"local checkpoint {local_dir} is corrupt: {rel} differs from its manifest")
        sent_bytes += meta["size"]
        stats.files += 1
    pointer = {"step": step, "uri": dest_uri, "manifest_sha256": ckpt.sha256_file(local_dir / ckpt.MANIFEST),
               "time_unix": time.time()}
    with_retries(f"step {step}: write {LATEST}", lambda: storage.write_json_atomic(fs, f"{root}/{LATEST}", pointer),
                 cfg, stats, stop)
    seconds = time.perf_counter() - started
    stats.bytes, stats.seconds = stats.bytes + sent_bytes, stats.seconds + seconds
    stats.checkpoints.append(step)
    log.info("uploaded checkpoint step %d to %s: %d files, %.1f MB in %.1f s (%.1f MB/s), %d retries, verified",
             step, dest_uri, len(manifest["files"]) + 1, sent_bytes / 1e6, seconds,
             sent_bytes / 1e6 / max(seconds, 1e-9), stats.retries - retries_before)
    prune_store(fs, root, cfg.store_keep_latest, step)
    return pointer, True


def prune_store(fs, root: str, keep_latest: int, latest_step: int) -> list[int]:
    """Delete step dirs older than the newest keep_latest complete ones (MANIFEST.json present),
    never latest_step. Best effort: a failure is logged and the next upload prunes again."""
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False, refresh=True)]
        steps = {int(n[5:]): f"{root}/{n}" for n in names if n.startswith("step_") and n[5:].isdigit()}
        complete = sorted(s for s, path in steps.items() if fs.exists(f"{path}/{ckpt.MANIFEST}"))
        keep = set(complete[-keep_latest:]) | {latest_step}
        # Only older dirs go: a newer one without a manifest may be an upload in progress.
        doomed = sorted(s for s in steps if s not in keep and s < max(keep))
        for s in doomed:
            fs.rm(steps[s], recursive=True)
    except Exception as exc:  # noqa: BLE001 - pruning must not fail an upload that succeeded
        log.warning("pruning old checkpoints under %s failed: %s: %s", root, type(exc).__name__, exc)
        return []
    if doomed:
        log.info("pruned checkpoints %s from the store (keeping %s)", doomed, sorted(keep))
    return doomed


class CheckpointUploader:
    """Uploads submitted checkpoints one at a time on a background thread.

    submit() returns at once: it hard-links the checkpoint's files into staging_dir (so the
    run directory's own keep-latest pruning cannot delete them mid-upload) and queues it.
    When several are queued, only the newest is uploaded (the older ones are superseded).
    """

    def __init__(self, store_uri: str, run_key: str, cfg: CheckpointConfig, staging_dir: Path) -> None:
        self.store_uri, self.run_key, self.cfg = store_uri, run_key, cfg
        self.staging_dir = Path(staging_dir)
        shutil.rmtree(self.staging_dir, ignore_errors=True)  # leftovers of a dead attempt
        self.stats = UploadStats()
        self._pending: list[tuple[int, Path]] = []
        self._busy = self._closed = False
        self._failure: UploadFailed | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        # Prefect ties a log line to its run through context variables: the thread runs in the
        # caller's context, so its lines join the task's logs instead of warning on each one.
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._work,),
                                        name=f"checkpoint-upload-{run_key}", daemon=True)
        self._thread.start()

    def submit(self, step: int, local_checkpoint_dir: str | Path) -> None:
        job = (step, self._snapshot(step, Path(local_checkpoint_dir)))
        with self._cond:
            if self._closed:
                raise RuntimeError("submit() on a closed CheckpointUploader")
            self._pending.append(job)
            self._cond.notify_all()

    def _snapshot(self, step: int, source: Path) -> Path:
        target = self.staging_dir / ckpt.step_dir_name(step)
        shutil.rmtree(target, ignore_errors=True)
        try:
            for path in source.rglob("*"):
                if path.is_file():
                    (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
                    os.link(path, target / path.relative_to(source))
            return target
        except OSError as exc:  # no hard links here: upload in place and hope pruning waits
            log.warning("cannot hard-link %s for upload (%s); uploading it in place", source, exc)
            shutil.rmtree(target, ignore_errors=True)
            return source

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                *superseded, job = self._pending
                self._pending.clear()
                self._busy = True
            for step, path in superseded:
                log.info("checkpoint step %d not uploaded: superseded by step %d", step, job[0])
                self._discard(path)
            try:
                self._upload(*job)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _upload(self, step: int, path: Path) -> None:
        try:
            upload_checkpoint(self.store_uri, self.run_key, step, path, self.cfg, self.stats, self._stop)
        except UploadFailed as exc:
            self._record_failure(step, exc)
        except Exception as exc:  # noqa: BLE001 - a bug must surface from wait(), not kill the thread
            failure = UploadFailed(f"checkpoint step {step}: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            self._record_failure(step, failure)
        finally:
            self._discard(path)

    def _record_failure(self, step: int, failure: UploadFailed) -> None:
        log.error("upload of checkpoint step %d failed; latest.json is unchanged: %s", step, failure)
        self._failure = failure
        self.stats.failures.append(f"step {step}: {failure}")

    def _discard(self, path: Path) -> None:
        if path.parent == self.staging_dir:  # never the run directory's own checkpoint
            shutil.rmtree(path, ignore_errors=True)

    def wait(self, timeout_seconds: float) -> UploadStats:
        """Block until every submitted checkpoint is uploaded (or skipped); raise the last failure."""
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            while self._pending or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"checkpoint uploads still running after {timeout_seconds:.0f} s")
                self._cond.wait(remaining)
        if self._failure is not None:
            raise self._failure
        return self.stats

    def close(self, timeout_seconds: float = 30.0) -> None:
        """Stop: queued uploads are dropped, retries abort, the thread ends after its current request."""
        self._stop.set()
        with self._cond:
            self._closed = True
            dropped, self._pending = self._pending, []
            self._cond.notify_all()
        for _, path in dropped:
            self._discard(path)
        self._thread.join(timeout_seconds)


def restore_latest(store_uri: str, run_key: str, checkpoints_dir: Path, cfg: CheckpointConfig) -> int | None:
    """When checkpoints_dir has no complete checkpoint (a new machine, a wiped work dir) but
    the store's latest.json exists, download that checkpoint; returns its step, else None.
    A complete local checkpoint always wins: it is at least as new as anything uploaded."""
    if ckpt.latest_complete_checkpoint(checkpoints_dir) is not None:
        return None
    stats = UploadStats()
    latest = read_latest(store_uri, run_key, cfg, stats)
    if latest is None:
        return None
    name = ckpt.step_dir_name(latest["step"])
    expected = storage.join_uri(checkpoints_uri(store_uri, run_key), name)
    if latest["uri"].rstrip("/") != expected:  # written by us, it names this run's own step directory
        raise storage.UploadVerificationError(f"latest.json of run {run_key} points at {latest['uri']}, not at "
                                              f"{expected}: refusing to download it")
    staging = checkpoints_dir / f"{name}.partial"

    def download() -> None:
        shutil.rmtree(staging, ignore_errors=True)
        storage.download_dir(latest["uri"], staging, cfg.upload_timeout_seconds)
        problem = ckpt.verify_checkpoint(staging)
        if problem is None and ckpt.sha256_file(staging / ckpt.MANIFEST) != latest["manifest_sha256"]:
            problem = "MANIFEST.json differs from the one latest.json names"
        if problem is not None:
            raise storage.UploadVerificationError(f"downloaded {latest['uri']}: {problem}")

    started = time.perf_counter()
    with_retries(f"download checkpoint step {latest['step']}", download, cfg, stats)
    shutil.rmtree(checkpoints_dir / name, ignore_errors=True)
    staging.rename(checkpoints_dir / name)
    log.info("restored checkpoint step %d from %s in %.1f s (%d retries)", latest["step"], latest["uri"],
             time.perf_counter() - started, stats.retries)
    return latest["step"]


class PublishedRun(BaseModel):
    """Where a finished run's artifacts are in the object store."""

    model_config = ConfigDict(frozen=True)
    checkpoint_uri: str
    """The final checkpoint (what runs/<run_key>/checkpoints/latest.json names)."""
    hf_export_uri: str
    bytes: int
    """Bytes uploaded by this call (0 for a checkpoint the driver had uploaded)."""
    checkpoint_uploaded_now: bool
    """False when the driver's background uploader had already stored the final checkpoint."""


def publish_run(store_uri: str, run_key: str, checkpoint_dir: Path, hf_export_dir: Path,
                cfg: CheckpointConfig) -> PublishedRun:
    """Make sure the final checkpoint is in the store (the driver normally uploaded it already:
    latest.json says so), then copy the HF export, verifying each file."""
    step = json.loads((checkpoint_dir / ckpt.MANIFEST).read_text())["step"]
    stats = UploadStats()
    pointer, uploaded_now = upload_checkpoint(store_uri, run_key, step, checkpoint_dir, cfg, stats)
    if uploaded_now:
        log.info("uploaded final checkpoint step %d (%.1f MB, %d retries)", step, stats.bytes / 1e6, stats.retries)
    else:
        log.info("final checkpoint step %d already in the store (latest.json): %s", step, pointer["uri"])
    export_uri = storage.join_uri(store_uri, "runs", run_key, "hf_export")
    export_files = storage.upload_dir(str(hf_export_dir), export_uri, cfg.upload_timeout_seconds,
                                      cfg.upload_part_megabytes << 20)
    total = sum(f["size"] for f in export_files.values())
    log.info("uploaded HF export: %d files (%.1f MB), sizes and sha256 verified", len(export_files), total / 1e6)
    return PublishedRun(checkpoint_uri=pointer["uri"], hf_export_uri=export_uri, bytes=total + stats.bytes,
                        checkpoint_uploaded_now=uploaded_now)
