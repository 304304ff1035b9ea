"""Publishing: verified upload to the object store, and registration in MLflow."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core.config import CheckpointConfig
from miles_core.storage import uploads
from miles_core.storage.uploads import PublishedRun
from miles_core.tracking import runs as tracking
from tasks.retry import retry_if_retryable


@task(name="upload-artifacts", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[5, 15, 45],
      retry_jitter_factor=0.5, retry_condition_fn=retry_if_retryable)
def upload_artifacts(store_uri: str, run_key: str, checkpoint_dir: str, hf_export_dir: str,
                     checkpoint: CheckpointConfig) -> PublishedRun:
    """The final checkpoint and the HF export in the store, each file verified."""
    return uploads.publish_run(store_uri, run_key, Path(checkpoint_dir), Path(hf_export_dir), checkpoint)


@task(name="register-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=retry_if_retryable)
def register_model(mlflow_uri: str, mlflow_run_id: str, name: str, hf_export_dir: str, tags: dict, step: int) -> str:
    version = tracking.register_model(mlflow_uri, mlflow_run_id, name, hf_export_dir, tags, step=step)
    get_run_logger().info("registered %s version %s (alias candidate)", name, version)
    return version
