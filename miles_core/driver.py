"""The training driver session: run_training plus what makes it durable, MLflow metrics
written as steps become durable and checkpoints uploaded in the background.

The flow's train task runs it inline (local mode) or submits it as a Ray Job
(`python -m miles_core.driver --job JOB.json`, see miles_core/ray_jobs.py); either way the
same code logs metrics and uploads, so a job that outlives its Prefect task loses nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import fsspec

from miles_core import checkpoint as ckpt
from miles_core import tracking, uploads
from miles_core.config import CheckpointConfig
from miles_core.loop import LoopState
from miles_core.storage import write_json_atomic
from miles_core.train import TrainSpec, run_training

log = logging.getLogger(__name__)


@dataclass
class DriverJob:
    """One driver session, as plain data (it is written to a file for Ray Jobs)."""

    train: dict
    """TrainSpec fields."""
    mlflow_uri: str
    mlflow_run_id: str
    store_uri: str | None = None
    """Object store the checkpoints are uploaded to; None keeps them local only."""
    run_key: str | None = None
    """Names the run's prefix in the store (runs/<run_key>/...)."""


def run_driver(job: DriverJob, on_step: Callable[[LoopState], None] = lambda s: None) -> dict:
    """Train; returns the TrainResult as a dict plus the checkpoint upload statistics."""
    spec = TrainSpec(**job.train)
    uploader = _start_uploads(job.store_uri, job.run_key, spec)
    metrics = tracking.MetricsLogger(job.mlflow_uri, job.mlflow_run_id)

    def on_checkpoint(step: int) -> None:
        metrics.flush()
        log.info("checkpoint at step %d", step)
        if uploader is not None:
            uploader.submit(step, Path(spec.run_dir, "checkpoints", ckpt.step_dir_name(step)))

    interval = spec.config["tracking"]["system_metrics_interval_seconds"]
    try:
        with tracking.system_metrics(job.mlflow_uri, job.mlflow_run_id, interval):
            result = run_training(spec, on_metrics=metrics.log, on_checkpoint=on_checkpoint, on_step=on_step)
    except BaseException:
        if uploader is not None:  # a retry starts its own uploader; this one must not race it
            uploader.close()
        raise
    metrics.flush()
    if result.resumed_from_step is not None:
        log.info("resumed from step %d", result.resumed_from_step)
    return asdict(result) | {"checkpoint_upload": _finish_uploads(uploader)}


def step_summary(state: LoopState) -> str:
    """One line per step for progress displays."""
    last = state.history[-1]
    score = (f"reward {last['rollout/reward_mean']:.3f}" if "rollout/reward_mean" in last
             else f"loss {last['train/loss']:.3f}")
    return f"{score}  step {last['time/step_seconds']:.2f}s"


def _start_uploads(store_uri: str | None, run_key: str | None, spec: TrainSpec) -> uploads.CheckpointUploader | None:
    """Restore the store's latest checkpoint when the run dir has no complete one (a new
    machine, a wiped work dir), then start the background uploader."""
    if not (store_uri and run_key):
        return None
    cfg = CheckpointConfig(**spec.config["checkpoint"])
    run_dir = Path(spec.run_dir)
    restored = uploads.restore_latest(store_uri, run_key, run_dir / "checkpoints", cfg)
    if restored is not None:
        log.info("restored checkpoint step %d from the object store", restored)
    return uploads.CheckpointUploader(store_uri, run_key, cfg, run_dir / "upload_staging")


def _finish_uploads(uploader: uploads.CheckpointUploader | None) -> dict:
    """Wait for queued uploads. A failure is logged, not raised: retrying training cannot fix
    the store, and upload-artifacts uploads the final checkpoint if latest.json lacks it."""
    if uploader is None:
        return {}
    try:
        uploader.wait(uploader.cfg.upload_wait_seconds)
    except (uploads.UploadFailed, TimeoutError) as exc:
        log.error("checkpoint upload incomplete (upload-artifacts will retry the final one): %s", exc)
    finally:
        uploader.close()
    s = uploader.stats
    log.info("checkpoint uploads: steps %s, %d files, %.1f MB, %.1f MB/s, %d retries, %d failures",
             s.checkpoints, s.files, s.bytes / 1e6, s.megabytes_per_second(), s.retries, len(s.failures))
    return {"steps": s.checkpoints, "files": s.files, "bytes": s.bytes, "seconds": round(s.seconds, 3),
            "retries": s.retries, "failures": s.failures}


def _write_result(path: str, record: dict) -> None:
    """Atomically: the watching task must never read a half-written result."""
    write_json_atomic(fsspec.filesystem("file"), str(Path(path).resolve()), record)


def main() -> None:
    """Ray Job entry point: run the session in JOB.json; report each step to PROGRESS
    (one JSON line per step, what the watching task's stall detection reads) and the
    result to RESULT."""
    import ray

    parser = argparse.ArgumentParser(description="Run one training driver session (a Ray Job's entry point).")
    parser.add_argument("--job", required=True, help="JSON file holding a DriverJob")
    parser.add_argument("--progress", required=True, help="JSON-lines file; one line is appended per step")
    parser.add_argument("--result", required=True, help="where the result JSON is written when training ends")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = DriverJob(**json.loads(Path(args.job).read_text()))
    ray.init(address="auto", ignore_reinit_error=True, log_to_driver=True)
    num_steps = job.train["config"]["training"]["num_steps"]
    with open(args.progress, "a") as progress:
        def on_step(state: LoopState) -> None:
            progress.write(json.dumps({"step": state.step, "time": time.time()}) + "\n")
            progress.flush()
            log.info("step %d/%d  %s", state.step, num_steps, step_summary(state))

        try:
            result = run_driver(job, on_step)
        except BaseException as exc:  # the watching task classifies it: retry or fail fast
            error = {"type": type(exc).__name__, "message": str(exc)[-2000:],
                     "mro": [cls.__name__ for cls in type(exc).__mro__]}
            _write_result(args.result, {"error": error})
            raise
    _write_result(args.result, result)


if __name__ == "__main__":
    main()
