"""Cached tasks for the deterministic artifacts (miles_core.storage.artifacts): model, data, warm-up,
conversion.

Each is keyed by the identity of what it produces and by where it is written (the absolute
work_dir), with JSON results persisted in the object store (`<store>/prefect-results/<key>`),
so a new flow run reuses them. The location is part of the key because a result is a set of
absolute paths: runs with different work dirs can share one object store, and must never
receive each other's paths. The public functions also check that what a cached result names is
still on disk, and rebuild it when it was deleted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prefect import task
from prefect.filesystems import LocalFileSystem, RemoteFileSystem

from miles_core.config import RunConfig
from miles_core.storage import artifacts
from miles_core.storage import object_store as storage
from miles_core.storage.artifacts import ConvertedModel, Dataset, ModelArtifact, WarmupArtifact
from tasks.retry import retry_if_retryable

RESULTS_PREFIX = "prefect-results"
CACHED = {"persist_result": True, "result_serializer": "json"}


def _located(cfg: RunConfig, identity: str) -> str:
    """The cache key: what is produced, plus where (see the module docstring)."""
    return f"{identity}-at-{artifacts.digest(str(cfg.storage.work_path))[:12]}"


def result_block(cfg: RunConfig) -> LocalFileSystem | RemoteFileSystem:
    """The filesystem block for <store>/prefect-results; it names a location only: S3
    credentials stay in the environment."""
    base = storage.join_uri(cfg.storage.store_uri(), RESULTS_PREFIX)
    if base.startswith("file://") or "://" not in base:  # Prefect's remote one refuses file:///
        return LocalFileSystem(basepath=base.removeprefix("file://"))
    if not base.startswith("s3"):
        return RemoteFileSystem(basepath=base)
    # a hung store fails the request instead of the run, as every other store call
    block = RemoteFileSystem(basepath=base, settings=storage.s3_settings(cfg.checkpoint.upload_timeout_seconds))
    storage.bounded_retries(block.filesystem)
    return block


def _result_storage(cfg: RunConfig) -> LocalFileSystem | RemoteFileSystem:
    """result_block, saved (Prefect wants result storage server-side)."""
    block = result_block(cfg)
    block.save(f"miles-results-{artifacts.digest(block.basepath)[:16]}", overwrite=True)
    return block


def _fresh(task, present: Callable, cfg: RunConfig, *args):
    """Run a cached artifact task, its result persisted in the run's object store; refresh the
    cache entry when what it names was deleted."""
    task = task.with_options(result_storage=_result_storage(cfg))
    result = task(cfg, *args)
    if not present(result):
        result = task.with_options(refresh_cache=True)(cfg, *args)
    return result


def _model_key(context, params) -> str:
    return _located(params["cfg"], artifacts.model_artifact_identity(params["cfg"]))


@task(name="prepare-model", cache_key_fn=_model_key, retries=2, retry_delay_seconds=[5, 30],
      retry_jitter_factor=0.5, retry_condition_fn=retry_if_retryable, **CACHED)
def _prepare_model(cfg: RunConfig) -> ModelArtifact:
    """Build, download or locate the starting model."""
    return artifacts.prepare_model(cfg)


def prepare_model(cfg: RunConfig) -> ModelArtifact:
    """The starting model (cached)."""
    return _fresh(_prepare_model, lambda model: Path(model.model_dir).is_dir(), cfg)


def prepare_teacher(cfg: RunConfig) -> ModelArtifact:
    """The distillation teacher (algorithm.teacher_source), prepared and cached like the model."""
    return prepare_model(artifacts.teacher_config(cfg))


def _data_key(context, params) -> str:
    return _located(params["cfg"], artifacts.dataset_identity(params["cfg"]))


@task(name="prepare-data", cache_key_fn=_data_key, **CACHED)
def _prepare_data(cfg: RunConfig) -> Dataset:
    """The train/eval jsonl paths: user files as given, or the built-in task generated."""
    return artifacts.prepare_data(cfg)


def prepare_data(cfg: RunConfig) -> Dataset:
    """The train/eval jsonl paths (cached)."""
    return _fresh(_prepare_data, lambda data: Path(data.train_path).is_file() and Path(data.eval_path).is_file(), cfg)


def _warmup_key(context, params) -> str:
    return _located(params["cfg"], artifacts.warmup_identity(params["cfg"], params["model"]))


@task(name="sft-warmup", cache_key_fn=_warmup_key, **CACHED)
def _sft_warmup(cfg: RunConfig, model: ModelArtifact, data: Dataset) -> WarmupArtifact:
    """A short SFT stage on the training labels."""
    return artifacts.warm_up(cfg, model, data)


def sft_warmup(cfg: RunConfig, model: ModelArtifact, data: Dataset) -> WarmupArtifact:
    """The SFT warm-up of `model` (cached); `model` itself when warmup.sft_steps is 0."""
    return _fresh(_sft_warmup, lambda warm: Path(warm.model_dir).is_dir(), cfg, model, data)


def _convert_key(context, params) -> str | None:
    """None (never cached) for fsdp2, whose stage is a no-op."""
    identity = artifacts.conversion_identity(params["cfg"], params["model"])
    return identity and _located(params["cfg"], identity)


@task(name="convert-checkpoint", cache_key_fn=_convert_key, **CACHED)
def _convert(cfg: RunConfig, model: ModelArtifact) -> ConvertedModel:
    """HF -> torch_dist for Megatron; a recorded no-op for fsdp2."""
    return artifacts.convert(cfg, model)


def convert_checkpoint(cfg: RunConfig, model: ModelArtifact) -> ConvertedModel:
    """HF -> the training backend's format (cached); an entry whose torch_dist directory was
    deleted is refreshed."""
    return _fresh(_convert, artifacts.conversion_present, cfg, model)
