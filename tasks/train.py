"""The train task: runs the training driver inline or as a Ray Job (placement.driver); a
retry resumes from the latest checkpoint, or re-attaches to the run's live driver job."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from miles_core import ray_jobs
from miles_core.config import PlacementConfig
from miles_core.driver import DriverJob, run_driver, step_summary
from miles_core.errors import is_retryable_class
from tasks.retry import retry_if_retryable


@task(name="train", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[10, 60],
      retry_jitter_factor=0.5, retry_condition_fn=retry_if_retryable)
def train(spec: dict, mlflow_uri: str, mlflow_run_id: str) -> dict:
    """RL training from spec; metrics go to the MLflow run as each step becomes durable, and
    each checkpoint is uploaded to spec["store_uri"] in the background (by the driver)."""
    spec = dict(spec)  # store_uri and run_key are for the driver session, not TrainSpec
    job = DriverJob(spec, mlflow_uri, mlflow_run_id, spec.pop("store_uri", None), spec.pop("run_key", None))
    placement = PlacementConfig(**spec["config"]["placement"])
    if placement.driver == "ray_job":
        return _train_as_ray_job(job, placement)
    return _train_inline(job)


def _train_inline(job: DriverJob) -> dict:
    progress = _progress_bar()
    with progress:
        bar = progress.add_task("rl", total=job.train["config"]["training"]["num_steps"], info="")
        return run_driver(job, lambda state: progress.update(bar, completed=state.step, info=step_summary(state)))


def _train_as_ray_job(job: DriverJob, placement: PlacementConfig) -> dict:
    logger = get_run_logger()
    if not job.run_key:
        raise ValueError("placement.driver=ray_job needs the run key (the flow passes spec['run_key'])")
    client = jobs_client(placement)
    driver_dir = Path(job.train["run_dir"], "driver")
    driver_dir.mkdir(parents=True, exist_ok=True)
    python = placement.job_python or sys.executable
    sid, attached = ray_jobs.submit_or_attach(client, job.run_key, driver_dir, job, python)
    logger.info("%s driver job %s", "re-attached to live" if attached else "submitted", sid)
    files = ray_jobs.JobFiles.of(driver_dir, sid)
    num_steps = job.train["config"]["training"]["num_steps"]
    try:
        status = ray_jobs.watch(client, sid, files, placement.job_stall_seconds, placement.job_poll_seconds,
                                on_step=lambda step: logger.info("driver job %s: step %d/%d", sid, step, num_steps),
                                on_log=print)
    except BaseException:  # task failure, cancellation, interrupt: no driver may outlive it
        client.stop_job(sid)
        raise
    # The driver logged its resume step and upload statistics itself (in the streamed job log).
    return ray_jobs.outcome(sid, status, files, is_retryable_class)


def jobs_client(placement: PlacementConfig) -> ray_jobs.TimeoutJobClient:
    address = placement.ray_jobs_address or os.environ.get("RAY_API_SERVER_ADDRESS")
    if not address:
        raise ValueError("placement.driver=ray_job needs the cluster's Jobs API: set placement.ray_jobs_address "
                         "(e.g. http://head:8265) or RAY_API_SERVER_ADDRESS (`miles stack up` sets it)")
    return ray_jobs.TimeoutJobClient(address)


def _progress_bar() -> Progress:
    return Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"))
