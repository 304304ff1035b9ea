"""The train task: runs the training driver inline or as a Ray Job (placement.driver); a
retry resumes from the latest checkpoint, or re-attaches to the run's live driver job."""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core.config import PlacementConfig
from miles_core.driver import ray_jobs
from miles_core.driver.session import TrainResult, TrainSpec, run_training
from tasks.retry import retry_if_retryable


@task(name="train", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[10, 60],
      retry_jitter_factor=0.5, retry_condition_fn=retry_if_retryable)
def train(spec: TrainSpec) -> TrainResult:
    """RL training of spec; metrics go to the spec's MLflow run as each step becomes durable,
    and each checkpoint is uploaded to spec.store_uri in the background (by the driver)."""
    if spec.config.placement.driver == "ray_job":
        return _train_as_ray_job(spec, spec.config.placement)
    return run_training(spec)


def _train_as_ray_job(spec: TrainSpec, placement: PlacementConfig) -> TrainResult:
    logger = get_run_logger()
    if not spec.run_key:
        raise ValueError("placement.driver=ray_job needs the run key (TrainSpec.run_key)")
    client = ray_jobs.jobs_client(placement)
    driver_dir = Path(spec.run_dir, "driver")
    driver_dir.mkdir(parents=True, exist_ok=True)
    python = placement.job_python or sys.executable
    sid, attached = ray_jobs.submit_or_attach(client, spec.run_key, driver_dir, spec, python)
    logger.info("%s driver job %s", "re-attached to live" if attached else "submitted", sid)
    files = ray_jobs.JobFiles.of(driver_dir, sid)
    num_steps = spec.config.training.num_steps
    try:
        status = ray_jobs.watch(client, sid, files, placement.job_stall_seconds, placement.job_poll_seconds,
                                on_step=lambda step: logger.debug("driver job %s: step %d/%d", sid, step, num_steps),
                                on_log=print)
    except BaseException:  # task failure, cancellation, interrupt: no driver may outlive it
        client.stop_job(sid)
        raise
    # The driver logged its progress, resume step and upload statistics itself (in the streamed job log).
    return ray_jobs.outcome(sid, status, files)
