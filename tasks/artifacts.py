"""Tasks that produce cached, deterministic artifacts: model, dataset, warm-up, conversion.

Each is keyed by the identity of what it produces (plus a version literal bumped when the
producing code changes) and by where it is written (the absolute work_dir), with JSON results
persisted in the object store (`<store>/prefect-results/<key>`), so a new flow run reuses them.
The location is part of the key because a result is a set of absolute paths: runs with
different work dirs can share one object store, and must never receive each other's paths. The
public functions also check that what a cached result names is still on disk, and rebuild it
when it was deleted."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from prefect import get_run_logger, task
from prefect.filesystems import LocalFileSystem, RemoteFileSystem

from miles_core import storage
from miles_core.config import RunConfig
from miles_core.models import materialize_model, model_identity
from tasks.retry import retry_if_retryable

ARTIFACT_VERSION = "v1"
RESULTS_PREFIX = "prefect-results"


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _located(cfg: RunConfig, content_key: str) -> str:
    """The cache key: what is produced, plus where (see the module docstring)."""
    return f"{content_key}-at-{_key(str(cfg.storage.work_path))[:12]}"


def _result_storage(cfg: RunConfig) -> LocalFileSystem | RemoteFileSystem:
    """A block for <store>/prefect-results, saved (Prefect wants result storage server-side);
    it names a location only: S3 credentials stay in the environment."""
    base = storage.join_uri(cfg.storage.store_uri(), RESULTS_PREFIX)
    if base.startswith("file://") or "://" not in base:  # Prefect's remote one refuses file:///
        block = LocalFileSystem(basepath=base.removeprefix("file://"))
    else:
        block = RemoteFileSystem(basepath=base)
    block.save(f"miles-results-{_key(base)[:16]}", overwrite=True)
    return block


def _fresh(task, present: Callable[[dict], bool], **kwargs) -> dict:
    """Run a cached artifact task, its result persisted in the run's object store; refresh the
    cache entry when what it names was deleted."""
    task = task.with_options(result_storage=_result_storage(RunConfig.model_validate(kwargs["config"])))
    result = task(**kwargs)
    if not present(result):
        result = task.with_options(refresh_cache=True)(**kwargs)
    return result


def _model_key(context, params) -> str:
    cfg = RunConfig.model_validate(params["config"])
    return _located(cfg, "model-" + _key(ARTIFACT_VERSION, model_identity(cfg.model)))


@task(name="prepare-model", cache_key_fn=_model_key, persist_result=True, result_serializer="json",
      retries=2, retry_delay_seconds=[5, 30], retry_jitter_factor=0.5, retry_condition_fn=retry_if_retryable)
def _prepare_model(config: dict) -> dict:
    """Build, download or locate the starting model; returns {model_dir, identity}."""
    cfg = RunConfig.model_validate(config)
    model_dir, identity = materialize_model(cfg.model, cfg.storage.cache_dir("models"))
    get_run_logger().info("model %s ready at %s", identity, model_dir)
    return {"model_dir": str(Path(model_dir).resolve()), "identity": identity}


def prepare_model(config: dict) -> dict:
    """The starting model (cached): {model_dir, identity}."""
    return _fresh(_prepare_model, lambda result: Path(result["model_dir"]).is_dir(), config=config)


def prepare_teacher(config: dict) -> dict:
    """The distillation teacher named by algorithm.teacher_source, prepared (and cached) exactly
    like the starting model: {model_dir, identity}."""
    teacher_source = config["algorithm"]["teacher_source"]
    return prepare_model(config={**config, "model": {**config["model"], "source": teacher_source}})


def _data_key(context, params) -> str:
    cfg = RunConfig.model_validate(params["config"])
    return _located(cfg, "data-" + _key(ARTIFACT_VERSION, cfg.data.model_dump(mode="json")))


@task(name="prepare-data", cache_key_fn=_data_key, persist_result=True, result_serializer="json")
def _prepare_data(config: dict) -> dict:
    """The train/eval jsonl paths: user files as given, or the built-in task generated."""
    from miles_core.data import write_arithmetic_task

    cfg = RunConfig.model_validate(config)
    if cfg.data.train_path and cfg.data.eval_path:
        paths = [Path(cfg.data.train_path), Path(cfg.data.eval_path)]
    else:
        out = cfg.storage.cache_dir("data") / _key(cfg.data.builtin.model_dump())
        generated = write_arithmetic_task(cfg.data.builtin, out)
        paths = [Path(cfg.data.train_path or generated[0]), Path(cfg.data.eval_path or generated[1])]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist (data.train_path / data.eval_path)")
    return {"train_path": str(paths[0].resolve()), "eval_path": str(paths[1].resolve())}


def prepare_data(config: dict) -> dict:
    """The train/eval jsonl paths (cached): {train_path, eval_path}."""
    return _fresh(_prepare_data, lambda result: all(Path(p).is_file() for p in result.values()), config=config)


def _warmup_id(cfg: RunConfig, model: dict) -> str:
    """What the warm-up produces, independent of where: its directory name and identity."""
    return "warmup-" + _key(ARTIFACT_VERSION, model["identity"], cfg.warmup.model_dump(),
                            cfg.data.model_dump(mode="json"), cfg.seed, cfg.training.micro_batch_size)


def _warmup_key(context, params) -> str:
    cfg = RunConfig.model_validate(params["config"])
    return _located(cfg, _warmup_id(cfg, params["model"]))


@task(name="sft-warmup", cache_key_fn=_warmup_key, persist_result=True, result_serializer="json")
def _sft_warmup(config: dict, model: dict, data: dict) -> dict:
    """A short SFT stage on the training labels; returns {model_dir, identity} of the result."""
    from transformers import AutoTokenizer

    from miles_core.data import read_prompts
    from miles_core.warmup import run_sft_warmup

    cfg = RunConfig.model_validate(config)
    if cfg.warmup.sft_steps == 0:
        return model
    logger = get_run_logger()
    key = _warmup_id(cfg, model)
    out_dir = cfg.storage.cache_dir("warmup") / key
    tokenizer = AutoTokenizer.from_pretrained(model["model_dir"])
    prompts = read_prompts(data["train_path"], cfg.data, tokenizer)

    def progress(step: int, loss: float, probe_pass_at_1: float | None) -> None:
        probe = "" if probe_pass_at_1 is None else f", probe pass@1 {probe_pass_at_1:.3f}"
        if (step + 1) % 50 == 0 or step + 1 == cfg.warmup.sft_steps:
            logger.info("sft warm-up step %d/%d loss %.3f%s", step + 1, cfg.warmup.sft_steps, loss, probe)

    result = run_sft_warmup(cfg, model["model_dir"], prompts, tokenizer, out_dir, on_step=progress)
    logger.info("sft warm-up done after %d steps (probe pass@1 %s, target %s)", result.steps,
                result.probe_pass_at_1, cfg.warmup.target_pass_at_1)
    return {"model_dir": str(out_dir), "identity": f"warmup:{key}", "sft_steps": result.steps,
            "probe_pass_at_1": result.probe_pass_at_1, "reached_target": result.reached_target}


def sft_warmup(config: dict, model: dict, data: dict) -> dict:
    """The SFT warm-up of `model` (cached): {model_dir, identity}; `model` when sft_steps is 0."""
    return _fresh(_sft_warmup, lambda result: Path(result["model_dir"]).is_dir(), config=config, model=model, data=data)


def _megatron_layout(cfg: RunConfig) -> dict[str, int]:
    m = cfg.training.megatron
    return {"tp": m.tensor_parallel_size, "pp": m.pipeline_parallel_size}


def _convert_id(cfg: RunConfig, model: dict) -> str:
    from miles_core.training.megatron.convert import CONVERTER_VERSION

    return "convert-" + _key(ARTIFACT_VERSION, model["identity"], _megatron_layout(cfg), CONVERTER_VERSION)


def _convert_key(context, params) -> str | None:
    """Model identity + (tp, pp) + the converter's version literal; None (never cached) for
    fsdp2, whose stage is a no-op. The identity names the exact weights (repo@revision, a
    listing digest, or the warm-up's own key), so hashing gigabytes is not needed here."""
    cfg = RunConfig.model_validate(params["config"])
    if cfg.training.backend == "fsdp2":
        return None
    return _located(cfg, _convert_id(cfg, params["model"]))


@task(name="convert-checkpoint", cache_key_fn=_convert_key, persist_result=True, result_serializer="json")
def _convert(config: dict, model: dict) -> dict:
    """HF -> torch_dist for Megatron under <work_dir>/cache/megatron/<key>; a recorded no-op for fsdp2."""
    cfg = RunConfig.model_validate(config)
    logger = get_run_logger()
    if cfg.training.backend == "fsdp2":
        logger.info("backend fsdp2 reads HF weights directly; no conversion needed")
        return {"format": "hf", "model_dir": model["model_dir"], "megatron_dir": None, "converted": False}
    from miles_core.training.megatron.convert import convert_hf_to_torch_dist

    key = _convert_id(cfg, model)
    out_dir = cfg.storage.cache_dir("megatron") / key
    layout = _megatron_layout(cfg)
    # Runs in this process (as prepare-model's download does); the converter writes MANIFEST.json
    # last and reuses a complete directory of the same key as is.
    manifest = convert_hf_to_torch_dist(model["model_dir"], out_dir, layout["tp"], layout["pp"], seed=cfg.seed)
    logger.info("converted %s to torch_dist %s (tp=%d, pp=%d, %d files)", model["identity"], out_dir,
                layout["tp"], layout["pp"], len(manifest["files"]))
    return {"format": "megatron_torch_dist", "model_dir": model["model_dir"], "megatron_dir": str(out_dir),
            "converted": True, "key": key}


def convert_checkpoint(config: dict, model: dict) -> dict:
    """HF -> the training backend's format: {format, model_dir (HF), megatron_dir (None for
    fsdp2), converted}. Cached; an entry whose torch_dist directory was deleted is refreshed."""
    from miles_core.training.megatron.convert import MANIFEST

    def present(result: dict) -> bool:
        return result["megatron_dir"] is None or (Path(result["megatron_dir"]) / MANIFEST).is_file()

    return _fresh(_convert, present, config=config, model=model)
