"""Tasks that produce cached, deterministic artifacts: model, dataset, warm-up, conversion.

Each is keyed by the identity of what it produces (plus a version literal bumped when the
producing code changes), with JSON results persisted, so a new flow run reuses them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefect import get_run_logger, task

from miles_core.config import RunConfig
from miles_core.models import materialize_model, model_identity
from tasks.retry import retry_infrastructure_only

ARTIFACT_VERSION = "v1"


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _model_key(context, params) -> str:
    cfg = RunConfig.model_validate(params["config"])
    return "model-" + _key(ARTIFACT_VERSION, model_identity(cfg.model))


@task(name="prepare-model", cache_key_fn=_model_key, persist_result=True, result_serializer="json",
      retries=2, retry_delay_seconds=[5, 30], retry_jitter_factor=0.5, retry_condition_fn=retry_infrastructure_only)
def prepare_model(config: dict) -> dict:
    """Build, download or locate the starting model; returns {model_dir, identity}."""
    cfg = RunConfig.model_validate(config)
    model_dir, identity = materialize_model(cfg.model, Path(cfg.storage.work_dir) / "cache" / "models")
    get_run_logger().info("model %s ready at %s", identity, model_dir)
    return {"model_dir": str(model_dir), "identity": identity}


def _data_key(context, params) -> str:
    cfg = RunConfig.model_validate(params["config"])
    return "data-" + _key(ARTIFACT_VERSION, cfg.data.model_dump(mode="json"))


@task(name="prepare-data", cache_key_fn=_data_key, persist_result=True, result_serializer="json")
def prepare_data(config: dict) -> dict:
    """The train/eval jsonl paths: user files as given, or the built-in task generated."""
    from miles_core.data import write_arithmetic_task

    cfg = RunConfig.model_validate(config)
    if cfg.data.train_path and cfg.data.eval_path:
        paths = [Path(cfg.data.train_path), Path(cfg.data.eval_path)]
    else:
        out = Path(cfg.storage.work_dir) / "cache" / "data" / _key(cfg.data.builtin.model_dump())
        generated = write_arithmetic_task(cfg.data.builtin, out)
        paths = [Path(cfg.data.train_path or generated[0]), Path(cfg.data.eval_path or generated[1])]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist (data.train_path / data.eval_path)")
    return {"train_path": str(paths[0].resolve()), "eval_path": str(paths[1].resolve())}


def _warmup_key(context, params) -> str:
    cfg = RunConfig.model_validate(params["config"])
    return "warmup-" + _key(ARTIFACT_VERSION, params["model"]["identity"], cfg.warmup.model_dump(),
                            cfg.data.model_dump(mode="json"), cfg.seed, cfg.training.micro_batch_size)


@task(name="sft-warmup", cache_key_fn=_warmup_key, persist_result=True, result_serializer="json")
def sft_warmup(config: dict, model: dict, data: dict) -> dict:
    """A short SFT stage on the training labels; returns {model_dir, identity} of the result."""
    from transformers import AutoTokenizer

    from miles_core.data import read_prompts
    from miles_core.warmup import run_sft_warmup

    cfg = RunConfig.model_validate(config)
    if cfg.warmup.sft_steps == 0:
        return model
    logger = get_run_logger()
    key = _warmup_key(None, {"config": config, "model": model})
    out_dir = Path(cfg.storage.work_dir) / "cache" / "warmup" / key
    tokenizer = AutoTokenizer.from_pretrained(model["model_dir"])
    prompts = read_prompts(data["train_path"], cfg.data, tokenizer)

    def progress(step: int, loss: float) -> None:
        if (step + 1) % 25 == 0 or step + 1 == cfg.warmup.sft_steps:
            logger.info("sft warm-up step %d/%d loss %.3f", step + 1, cfg.warmup.sft_steps, loss)

    run_sft_warmup(cfg, model["model_dir"], prompts, tokenizer, out_dir, on_step=progress)
    return {"model_dir": str(out_dir), "identity": f"warmup:{key}"}


@task(name="convert-checkpoint", persist_result=False)
def convert_checkpoint(config: dict, model: dict) -> dict:
    """HF -> the training backend's format. FSDP2 trains on HF weights: a recorded no-op."""
    cfg = RunConfig.model_validate(config)
    if cfg.training.backend == "fsdp2":
        get_run_logger().info("backend fsdp2 reads HF weights directly; no conversion needed")
        return {"format": "hf", "model_dir": model["model_dir"], "converted": False}
    raise NotImplementedError("training.backend=megatron conversion is not available in this build")
