"""Publishing: verified upload to the object store, and registration in MLflow."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from miles_core import checkpoint as ckpt
from miles_core import storage, tracking, uploads
from miles_core.config import CheckpointConfig
from tasks.retry import retry_if_retryable


@task(name="upload-artifacts", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[5, 15, 45],
      retry_jitter_factor=0.5, retry_condition_fn=retry_if_retryable)
def upload_artifacts(store_uri: str, run_key: str, checkpoint_dir: str, hf_export_dir: str,
                     checkpoint_config: dict | None = None) -> dict:
    """Make sure the final checkpoint is in the store (the train task normally uploaded it
    already: latest.json says so), then copy the HF export, verifying each file."""
    logger = get_run_logger()
    cfg = CheckpointConfig(**(checkpoint_config or {}))
    step = json.loads((Path(checkpoint_dir) / ckpt.MANIFEST).read_text())["step"]
    stats = uploads.UploadStats()
    pointer, uploaded_now = uploads.upload_checkpoint(store_uri, run_key, step, Path(checkpoint_dir), cfg, stats)
    if uploaded_now:
        logger.info("uploaded final checkpoint step %d (%.1f MB, %d retries)", step, stats.bytes / 1e6, stats.retries)
    else:
        logger.info("final checkpoint step %d already in the store (latest.json): %s", step, pointer["uri"])
    export_uri = storage.join_uri(store_uri, "runs", run_key, "hf_export")
    export_files = storage.upload_dir(hf_export_dir, export_uri, cfg.upload_timeout_seconds,
                                      cfg.upload_part_megabytes << 20)
    total = sum(f["size"] for f in export_files.values())
    logger.info("uploaded HF export: %d files (%.1f MB), sizes and sha256 verified", len(export_files), total / 1e6)
    return {"checkpoint_uri": pointer["uri"], "hf_export_uri": export_uri, "bytes": total + stats.bytes,
            "checkpoint_uploaded_now": uploaded_now}


@task(name="register-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=retry_if_retryable)
def register_model(mlflow_uri: str, mlflow_run_id: str, name: str, hf_export_dir: str, tags: dict) -> str:
    version = tracking.register_model(mlflow_uri, mlflow_run_id, name, hf_export_dir, tags)
    get_run_logger().info("registered %s version %s (alias candidate)", name, version)
    return version
