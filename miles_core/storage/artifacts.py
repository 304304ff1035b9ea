"""The deterministic artifacts a run starts from: model, dataset, warm-up, Megatron conversion.

Each producer returns a typed result naming what it wrote, and each artifact has an identity
(`*_identity`): what it is, independent of where, built from the identity of its inputs plus
ARTIFACT_VERSION (bumped when a producer's output changes). The flow's tasks cache on those
identities; nothing here knows of Prefect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import fsspec
from pydantic import BaseModel, ConfigDict

from miles_core.config import RunConfig
from miles_core.storage.models import materialize_model, model_identity
from miles_core.storage.object_store import write_json_atomic

log = logging.getLogger(__name__)
ARTIFACT_VERSION = "v2"
WARMUP_RECORD = "WARMUP.json"


class StageResult(BaseModel):
    """A stage's typed result: immutable, JSON round-trippable (Prefect persists it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelArtifact(StageResult):
    model_dir: str
    """Local HF-format directory (absolute)."""
    identity: str
    """What the weights are (repo@revision, a listing digest, a warm-up key), independent of where."""


class WarmupArtifact(ModelArtifact):
    sft_steps: int = 0
    """SFT steps trained (0: no warm-up, the starting model is passed through)."""
    probe_pass_at_1: float | None = None
    """Greedy pass@1 on the held-out probe prompts at the end (None without a target)."""
    reached_target: bool | None = None
    """Whether warmup.target_pass_at_1 was reached (None without a target)."""


class Dataset(StageResult):
    train_path: str
    """jsonl of training prompts (absolute)."""
    eval_path: str
    """jsonl of held-out prompts (absolute)."""


class ConvertedModel(StageResult):
    model_dir: str
    """The HF directory (engines and fsdp2 read it; Megatron exports back to its layout)."""
    megatron_dir: str | None = None
    """torch_dist directory the Megatron trainer starts from; None for fsdp2."""


def digest(*parts: object) -> str:
    """A short stable hash of JSON-able parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def model_artifact_identity(cfg: RunConfig) -> str:
    return "model-" + digest(ARTIFACT_VERSION, model_identity(cfg.model))


def prepare_model(cfg: RunConfig) -> ModelArtifact:
    """Build, download or locate the starting model (cfg.model.source)."""
    model_dir, identity = materialize_model(cfg.model, cfg.storage.cache_dir("models"))
    log.info("model %s ready at %s", identity, model_dir)
    return ModelArtifact(model_dir=str(Path(model_dir).resolve()), identity=identity)


def teacher_config(cfg: RunConfig) -> RunConfig:
    """The recipe with model.source set to the distillation teacher: the teacher is prepared
    (downloaded, cached) exactly like the starting model."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"source": cfg.algorithm.teacher_source})})


def dataset_identity(cfg: RunConfig) -> str:
    return "data-" + digest(ARTIFACT_VERSION, cfg.data.model_dump(mode="json"))


def prepare_data(cfg: RunConfig) -> Dataset:
    """The train/eval jsonl paths: user files as given, or the built-in task generated."""
    from miles_core.data import write_arithmetic_task

    if cfg.data.train_path and cfg.data.eval_path:
        paths = [Path(cfg.data.train_path), Path(cfg.data.eval_path)]
    else:
        out = cfg.storage.cache_dir("data") / digest(cfg.data.builtin.model_dump())
        generated = write_arithmetic_task(cfg.data.builtin, out)
        paths = [Path(cfg.data.train_path or generated[0]), Path(cfg.data.eval_path or generated[1])]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist (data.train_path / data.eval_path)")
    return Dataset(train_path=str(paths[0].resolve()), eval_path=str(paths[1].resolve()))


def warmup_identity(cfg: RunConfig, model: ModelArtifact) -> str:
    # The warm-up trains on training.backend, so a Megatron recipe must not reuse an FSDP2
    # warm-up; FSDP2's key leaves the backend out, so warm-ups cached before it counted stay valid.
    backend = () if cfg.training.backend == "fsdp2" else (cfg.training.backend,)
    return "warmup-" + digest(ARTIFACT_VERSION, model.identity, cfg.warmup.model_dump(),
                              cfg.data.model_dump(mode="json"), cfg.seed, cfg.training.micro_batch_size, *backend)


def warm_up(cfg: RunConfig, model: ModelArtifact, data: Dataset) -> WarmupArtifact:
    """The SFT warm-up of `model` on the training labels (model itself when sft_steps is 0)."""
    if cfg.warmup.sft_steps == 0:
        return WarmupArtifact(model_dir=model.model_dir, identity=model.identity)
    from transformers import AutoTokenizer

    from miles_core.data import read_prompts
    from miles_core.warmup import run_sft_warmup

    key = warmup_identity(cfg, model)
    out_dir = cfg.storage.cache_dir("warmup") / key
    record = out_dir / WARMUP_RECORD
    if record.is_file():  # keyed by everything it depends on, written last: a complete warm-up
        log.info("sft warm-up %s already complete at %s", key, out_dir)
        return WarmupArtifact.model_validate_json(record.read_text())
    shutil.rmtree(out_dir, ignore_errors=True)  # an interrupted attempt's leftovers
    tokenizer = AutoTokenizer.from_pretrained(model.model_dir)
    prompts = read_prompts(data.train_path, cfg.data, tokenizer)

    def progress(step: int, loss: float, probe_pass_at_1: float | None) -> None:
        probe = "" if probe_pass_at_1 is None else f", probe pass@1 {probe_pass_at_1:.3f}"
        if (step + 1) % 50 == 0 or step + 1 == cfg.warmup.sft_steps:
            log.info("sft warm-up step %d/%d loss %.3f%s", step + 1, cfg.warmup.sft_steps, loss, probe)

    result = run_sft_warmup(cfg, model.model_dir, prompts, tokenizer, out_dir, on_step=progress)
    log.info("sft warm-up done after %d steps (probe pass@1 %s, target %s)", result.steps,
             result.probe_pass_at_1, cfg.warmup.target_pass_at_1)
    artifact = WarmupArtifact(model_dir=str(out_dir), identity=f"warmup:{key}", sft_steps=result.steps,
                              probe_pass_at_1=result.probe_pass_at_1, reached_target=result.reached_target)
    # Atomically: a torn record would fail every resume.
    write_json_atomic(fsspec.filesystem("file"), str(record.resolve()), artifact.model_dump(mode="json"))
    return artifact


def conversion_identity(cfg: RunConfig, model: ModelArtifact) -> str | None:
    """Model identity + (tp, pp) + the converter's version literal; None for fsdp2 (nothing to
    convert). The identity names the exact weights, so hashing gigabytes is not needed."""
    if cfg.training.backend == "fsdp2":
        return None
    from miles_core.training.megatron.convert import CONVERTER_VERSION

    m = cfg.training.megatron
    return "convert-" + digest(ARTIFACT_VERSION, model.identity, {"tp": m.tensor_parallel_size,
                                                                   "pp": m.pipeline_parallel_size}, CONVERTER_VERSION)


def convert(cfg: RunConfig, model: ModelArtifact) -> ConvertedModel:
    """HF -> torch_dist under <work_dir>/cache/megatron/<identity> for Megatron; fsdp2 reads HF."""
    key = conversion_identity(cfg, model)
    if key is None:
        log.info("backend fsdp2 reads HF weights directly; no conversion needed")
        return ConvertedModel(model_dir=model.model_dir)
    from miles_core.training.megatron.convert import convert_hf_to_torch_dist

    out_dir = cfg.storage.cache_dir("megatron") / key
    m = cfg.training.megatron
    # The converter writes MANIFEST.json last and reuses a complete directory of the same key.
    manifest = convert_hf_to_torch_dist(model.model_dir, out_dir, m.tensor_parallel_size, m.pipeline_parallel_size,
                                        seed=cfg.seed)
    log.info("converted %s to torch_dist %s (tp=%d, pp=%d, %d files)", model.identity, out_dir,
             m.tensor_parallel_size, m.pipeline_parallel_size, len(manifest["files"]))
    return ConvertedModel(model_dir=model.model_dir, megatron_dir=str(out_dir))


def conversion_present(converted: ConvertedModel) -> bool:
    from miles_core.training.megatron.convert import MANIFEST

    return converted.megatron_dir is None or (Path(converted.megatron_dir) / MANIFEST).is_file()


def fetch_model(model_uri: str, cfg: RunConfig, dest: Path) -> Path:
    """A local HF directory for model_uri: a registry version (models:/name@alias or /version),
    an object-store URI (downloaded under dest), or a local path used in place. A training
    checkpoint (model.safetensors, no config.json) gets the config and tokenizer of the recipe's
    starting model, which has the same architecture."""
    from miles_core.storage import object_store as storage
    from miles_core.tracking import registry
    from miles_core.tracking import runs as tracking

    if model_uri.startswith("models:/"):
        local = registry.download_model(tracking.tracking_uri(cfg), model_uri, dest / "download")
    elif "://" in model_uri:
        local = storage.download_dir(model_uri, dest / "download", cfg.model.request_timeout_seconds)
    else:
        local = Path(model_uri).expanduser().resolve()
    if (local / "config.json").is_file():
        return local
    if not (local / "model.safetensors").is_file():
        raise FileNotFoundError(f"{local} has neither config.json (HF export) nor model.safetensors (checkpoint)")
    base, _ = materialize_model(cfg.model, cfg.storage.cache_dir("models"))
    hf_dir = dest / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
            shutil.copy2(path, hf_dir / path.name)
    shutil.copy2(local / "model.safetensors", hf_dir / "model.safetensors")
    return hf_dir
