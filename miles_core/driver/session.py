"""The training driver: one session of a run, from a TrainSpec to a TrainResult.

It opens the TrainingRun (actors, engines, transport), resumes from the latest complete
checkpoint, runs the loop, and exports the policy; with an MLflow run and an object store in
the spec it also logs each step's metrics before the checkpoint that covers it, and uploads
each checkpoint in the background. The flow's train task runs it inline, or as a Ray Job
(`python -m miles_core.driver.session --spec SPEC.json ...`, see miles_core/driver/ray_jobs.py); either way
the same code logs and uploads, so a job that outlives its Prefect task loses nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
from pydantic import BaseModel, ConfigDict

from miles_core.config import RunConfig
from miles_core.driver.loop import run_loop
from miles_core.driver.run import LoopState, MetricsFn, RunHooks, TrainingRun
from miles_core.metrics import PERIODIC_HELDOUT_PASS_AT_1, REWARD_MEAN, STEP_SECONDS, TRAIN_LOSS
from miles_core.storage import checkpoint as ckpt
from miles_core.storage import uploads
from miles_core.storage.object_store import write_json_atomic
from miles_core.tracking import runs as tracking

log = logging.getLogger(__name__)
HELDOUT_PASS_AT_1 = PERIODIC_HELDOUT_PASS_AT_1  # the name benches import


class TrainSpec(BaseModel):
    """Everything a driver session needs, as data (it crosses process boundaries as JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    config: RunConfig
    model_dir: str
    """HF directory the trainer and the engines start from."""
    train_path: str
    """jsonl of training prompts."""
    run_dir: str
    """Local run directory: checkpoints, HF export, driver files."""
    teacher_dir: str | None = None
    """HF directory of the distillation teacher; None without distillation."""
    eval_path: str | None = None
    """Held-out prompts of periodic evaluation (eval.interval_steps); None disables it."""
    megatron_dir: str | None = None
    """Converted torch_dist directory the Megatron trainer starts from; None starts it from
    model_dir's HF weights (fsdp2 always reads model_dir)."""
    store_uri: str | None = None
    """Object store the checkpoints are uploaded to; None keeps them local only."""
    run_key: str | None = None
    """The run's identity: its prefix in the store (runs/<run_key>/...), its Ray Job ids."""
    mlflow_uri: str | None = None
    """MLflow tracking URI of the run's metrics; None logs none."""
    mlflow_run_id: str | None = None


class UploadReport(BaseModel):
    steps: list[int] = []
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    failures: list[str] = []


class TrainResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    steps: int
    resumed_from_step: int | None
    final_checkpoint_dir: str
    hf_export_dir: str
    history: list[dict[str, float]]
    """Metrics of each step this session trained."""
    periodic_eval: list[dict[str, float]] = []
    checkpoint_upload: UploadReport | None = None
    """None when the spec names no object store."""


def run_training(spec: TrainSpec, on_step: Callable[[LoopState], None] | None = None,
                 on_metrics: MetricsFn | None = None, on_checkpoint: Callable[[int], None] | None = None
                 ) -> TrainResult:
    """Train the spec's run to training.num_steps, resuming from its latest checkpoint. The
    callbacks see what MLflow and the uploader see (metrics per step, each durable checkpoint)."""
    cfg = spec.config
    uploader = _start_uploads(spec)
    mlflow = tracking.MetricsLogger(spec.mlflow_uri, spec.mlflow_run_id) if spec.mlflow_run_id else None
    progress = ProgressLog(cfg)

    def flush_metrics(step: int) -> None:
        if mlflow:
            mlflow.flush()

    def upload(step: int) -> None:
        if uploader is not None:
            uploader.submit(step, Path(spec.run_dir, "checkpoints", ckpt.step_dir_name(step)))

    def checkpointed(step: int) -> None:
        log.info("checkpoint at step %d", step)
        upload(step)
        _call(on_checkpoint, step)

    def logged(step: int, metrics: dict[str, float]) -> None:
        progress.record(step, metrics)
        _call(mlflow and mlflow.log, step, metrics)
        _call(on_metrics, step, metrics)

    def stepped(state: LoopState) -> None:
        progress.step(state)
        _call(on_step, state)

    hooks = RunHooks(on_metrics=logged, before_checkpoint=flush_metrics, on_checkpoint=checkpointed, on_step=stepped)
    try:
        with tracking.system_metrics(spec.mlflow_uri, spec.mlflow_run_id, cfg.tracking.system_metrics_interval_seconds):
            run = TrainingRun.open(cfg, spec.run_dir, spec.model_dir, spec.train_path, eval_path=spec.eval_path,
                                   teacher_dir=spec.teacher_dir, megatron_dir=spec.megatron_dir, hooks=hooks,
                                   run_key=spec.run_key)
            try:
                state, resumed_from = run.resume()
                if resumed_from is not None:  # a kill may have beaten its upload; a stored one is skipped
                    upload(resumed_from)
                state = run_loop(run, state)
                export_dir = run.export_hf()
            finally:
                run.close()
    except BaseException:
        if uploader is not None:  # a retry starts its own uploader; this one must not race it
            uploader.close()
        raise
    final = ckpt.latest_complete_checkpoint(run.checkpoints_dir)
    return TrainResult(steps=state.step, resumed_from_step=resumed_from, final_checkpoint_dir=str(final[1]),
                       hf_export_dir=str(export_dir), history=state.history, periodic_eval=state.periodic_eval,
                       checkpoint_upload=_finish_uploads(uploader))


def _call(fn: Callable | None, *args) -> None:
    if fn is not None:
        fn(*args)


class ProgressLog:
    """A log line every tracking.log_interval_steps steps: step, reward (or loss), the latest
    periodic eval, step time."""

    def __init__(self, cfg: RunConfig):
        self.interval, self.num_steps = cfg.tracking.log_interval_steps, cfg.training.num_steps
        self.latest_eval: str = ""

    def record(self, step: int, values: dict[str, float]) -> None:
        heldout = values.get(PERIODIC_HELDOUT_PASS_AT_1)
        if heldout is not None:
            self.latest_eval = f"  eval pass@1 {heldout:.3f} (step {step})"

    def step(self, state: LoopState) -> None:
        if state.step % self.interval == 0 or state.step == self.num_steps:
            log.info("step %d/%d  %s%s", state.step, self.num_steps, step_summary(state), self.latest_eval)


def step_summary(state: LoopState) -> str:
    """Reward (or loss) and step time of the last step."""
    last = state.history[-1]
    score = (f"reward {last[REWARD_MEAN]:.3f}" if REWARD_MEAN in last
             else f"loss {last[TRAIN_LOSS]:.3f}")
    return f"{score}  step {last[STEP_SECONDS]:.2f}s"


def _start_uploads(spec: TrainSpec) -> uploads.CheckpointUploader | None:
    """Restore the store's latest checkpoint when the run dir has no complete one (a new
    machine, a wiped work dir), then start the background uploader."""
    if not (spec.store_uri and spec.run_key):
        return None
    cfg, run_dir = spec.config.checkpoint, Path(spec.run_dir)
    restored = uploads.restore_latest(spec.store_uri, spec.run_key, run_dir / "checkpoints", cfg)
    if restored is not None:
        log.info("restored checkpoint step %d from the object store", restored)
    return uploads.CheckpointUploader(spec.store_uri, spec.run_key, cfg, run_dir / "upload_staging")


def _finish_uploads(uploader: uploads.CheckpointUploader | None) -> UploadReport | None:
    """Wait for queued uploads. A failure is logged, not raised: retrying training cannot fix
    the store, and upload-artifacts uploads the final checkpoint if latest.json lacks it."""
    if uploader is None:
        return None
    try:
        uploader.wait(uploader.cfg.upload_wait_seconds)
    except (uploads.UploadFailed, TimeoutError) as exc:
        log.error("checkpoint upload incomplete (upload-artifacts will retry the final one): %s", exc)
    finally:
        uploader.close()
    s = uploader.stats
    log.info("checkpoint uploads: steps %s, %d files, %.1f MB, %.1f MB/s, %d retries, %d failures",
             s.checkpoints, s.files, s.bytes / 1e6, s.megabytes_per_second(), s.retries, len(s.failures))
    return UploadReport(steps=s.checkpoints, files=s.files, bytes=s.bytes, seconds=round(s.seconds, 3),
                        retries=s.retries, failures=s.failures)


class JobError(BaseModel):
    """What a Ray Job driver raised, for the watching task to classify (retry or fail fast)."""

    type: str
    message: str
    class_names: list[str]
    """Names of the classes in the exception's MRO (what is_retryable_class reads)."""


def _write_result(path: str, record: dict) -> None:
    """Atomically: the watching task must never read a half-written result."""
    write_json_atomic(fsspec.filesystem("file"), str(Path(path).resolve()), record)


def main() -> None:
    """Ray Job entry point: run the session in SPEC.json; report each step to PROGRESS
    (one JSON line per step, what the watching task's stall detection reads) and the
    result (a TrainResult, or {"error": JobError}) to RESULT."""
    import ray

    parser = argparse.ArgumentParser(description="Run one training driver session (a Ray Job's entry point).")
    parser.add_argument("--spec", required=True, help="JSON file holding a TrainSpec")
    parser.add_argument("--progress", required=True, help="JSON-lines file; one line is appended per step")
    parser.add_argument("--result", required=True, help="where the result JSON is written when training ends")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = TrainSpec.model_validate_json(Path(args.spec).read_text())
    ray.init(address="auto", ignore_reinit_error=True, log_to_driver=True)
    with open(args.progress, "a") as progress:
        def on_step(state: LoopState) -> None:
            progress.write(json.dumps({"step": state.step, "time": time.time()}) + "\n")
            progress.flush()

        try:
            result = run_training(spec, on_step)
        except BaseException as exc:  # the watching task classifies it: retry or fail fast
            error = JobError(type=type(exc).__name__, message=str(exc)[-2000:],
                             class_names=[cls.__name__ for cls in type(exc).__mro__])
            _write_result(args.result, {"error": error.model_dump()})
            raise
    _write_result(args.result, result.model_dump(mode="json"))


if __name__ == "__main__":
    main()
