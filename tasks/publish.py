"""Publishing: verified upload to the object store, and registration in MLflow."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core import storage, tracking
from tasks.retry import retry_infrastructure_only


@task(name="upload-artifacts", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[5, 15, 45],
      retry_jitter_factor=0.5, retry_condition_fn=retry_infrastructure_only)
def upload_artifacts(store_uri: str, run_key: str, checkpoint_dir: str, hf_export_dir: str) -> dict:
    """Copy the final checkpoint and HF export under runs/<run_key>/, verifying each file."""
    from pathlib import Path

    checkpoint_uri = storage.join_uri(store_uri, "runs", run_key, "checkpoints", Path(checkpoint_dir).name)
    export_uri = storage.join_uri(store_uri, "runs", run_key, "hf_export")
    checkpoint_files = storage.upload_dir(checkpoint_dir, checkpoint_uri)
    export_files = storage.upload_dir(hf_export_dir, export_uri)
    total = sum(f["size"] for f in [*checkpoint_files.values(), *export_files.values()])
    get_run_logger().info("uploaded %d files (%.1f MB), sizes and sha256 verified",
                          len(checkpoint_files) + len(export_files), total / 1e6)
    return {"checkpoint_uri": checkpoint_uri, "hf_export_uri": export_uri, "bytes": total}


@task(name="register-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=retry_infrastructure_only)
def register_model(mlflow_uri: str, mlflow_run_id: str, name: str, hf_export_dir: str, tags: dict) -> str:
    version = tracking.register_model(mlflow_uri, mlflow_run_id, name, hf_export_dir, tags)
    get_run_logger().info("registered %s version %s (alias candidate)", name, version)
    return version
