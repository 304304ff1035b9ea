"""HF safetensors <-> Megatron torch_dist checkpoints (megatron.core.dist_checkpointing).

A converted directory::

    out_dir/torch_dist/   dist_checkpointing.save of GPTModel.sharded_state_dict()
    out_dir/hf/           the HF directory minus weights (config, tokenizer, generation config)
    out_dir/MANIFEST.json written last: files (size, sha256), key, layout, source digest

The cache key is sha256(model digest of the HF safetensors + config, layout (tp, pp),
CONVERTER_VERSION): the same HF weights converted by the same code give the same key.
torch_dist checkpoints are layout-independent on load (a TP=1 save loads at TP=2).

Loading note: dist_checkpointing's torch_dist load goes through torch.distributed.checkpoint,
whose FileSystemReader reads ``.metadata`` with ``pickle.load``; we run it through a restricted
unpickler (safe_metadata.py) that builds only DCP's metadata classes. BYTE_IO items (ShardedObjects)
would be read with ``torch.load(weights_only=False)``: we never write them (the local spec's
``_extra_state`` entries are None and are dropped), and metadata declaring any is refused before
the load is planned. ``common.pt`` is read with
torch.load's default (weights_only=True, with megatron's safe globals), and
:func:`load_model_checkpoint` verifies the MANIFEST sha256 of every file before loading.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from miles_core.storage.checkpoint import sha256_file
from miles_core.training.megatron.safe_metadata import read_metadata, restricted_metadata_loading

CONVERTER_VERSION = "miles-megatron-torch_dist-v1"
MANIFEST = "MANIFEST.json"
TORCH_DIST = "torch_dist"
HF_META = "hf"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


# ---- identity -------------------------------------------------------------------------------------
def model_digest(hf_dir: str | Path) -> str:
    """sha256 over the names and contents of an HF directory's safetensors files and config.json."""
    hf_dir = Path(hf_dir)
    digest = hashlib.sha256()
    files = sorted(hf_dir.glob("*.safetensors")) + [hf_dir / "config.json"]
    for path in files:
        digest.update(path.name.encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def conversion_key(hf_digest: str, tp: int = 1, pp: int = 1) -> str:
    blob = json.dumps({"model": hf_digest, "layout": {"tp": tp, "pp": pp}, "converter": CONVERTER_VERSION},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def write_manifest(directory: Path, **fields: Any) -> dict:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {**fields, "created_unix": time.time(),
                "files": {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                          for p in files}}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify_manifest(directory: str | Path) -> dict:
    """The manifest of a complete, intact directory; ValueError otherwise."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"{directory} has no {MANIFEST}: incomplete or not a converted checkpoint")
    manifest = json.loads(path.read_text())
    for rel, meta in manifest["files"].items():
        file = directory / rel
        if not file.is_file() or file.stat().st_size != meta["size"] or sha256_file(file) != meta["sha256"]:
            raise ValueError(f"{directory}: {rel} is missing or differs from {MANIFEST}")
    return manifest


# ---- HF weights -----------------------------------------------------------------------------------
def load_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(str(path)))
    return weights


def copy_hf_meta(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Config, tokenizer and other small files of an HF directory, without the weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in Path(hf_dir).iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name != "model.safetensors.index.json":
            shutil.copy2(path, out_dir / path.name)
    return out_dir


# ---- sharded state dicts --------------------------------------------------------------------------
def model_sharded_state_dict(model) -> dict:
    """The model's sharded state dict without the (None) `_extra_state` objects."""
    return {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}


def save_sharded(sharded_state_dict: dict, directory: str | Path) -> None:
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sharded_state_dict, str(directory))
    torch.distributed.barrier()


def load_sharded(sharded_state_dict: dict, directory: str | Path) -> dict:
    from megatron.core import dist_checkpointing

    # Read and checked once here so a refusal reaches the caller as it is, not wrapped in DCP's
    # per-rank CheckpointException; the load below reads it through the same check again.
    read_metadata(directory)
    with restricted_metadata_loading():
        return dist_checkpointing.load(sharded_state_dict, str(directory))


def load_model_checkpoint(model, directory: str | Path) -> None:
    """Fill a (any-TP) GPTModel from a torch_dist directory (converter or trainer layout)."""
    loaded = load_sharded(model_sharded_state_dict(model), directory)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"torch_dist checkpoint does not fit the model: missing={missing[:5]} "
                           f"unexpected={unexpected[:5]}")


# ---- conversion -------------------------------------------------------------------------------------
def _dtype_of(weights: dict[str, torch.Tensor]) -> torch.dtype:
    floats = [t.dtype for t in weights.values() if t.is_floating_point()]
    return max(set(floats), key=floats.count) if floats else torch.float32


def _convert_rank(rank: int, world_size: int, hf_dir: str, out_dir: str, tp: int, pp: int, seed: int) -> None:
    from transformers import AutoConfig

    from miles_core.training.megatron import mapping
    from miles_core.training.megatron.model import build_gpt_model, init_parallel, model_shape

    torch.set_num_threads(1 if world_size > 1 else torch.get_num_threads())
    init_parallel(tp, pp, seed=seed)
    from megatron.core import parallel_state

    hf_config = AutoConfig.from_pretrained(hf_dir)
    weights = load_hf_weights(hf_dir)
    model = build_gpt_model(hf_config, tp, dtype=_dtype_of(weights))
    shape = model_shape(hf_config, tp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    state = mapping.hf_to_megatron_rank(weights, shape, tp, tp_rank)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"HF weights do not fit the Megatron model: missing={missing[:5]} "
                           f"unexpected={unexpected[:5]}")
    save_sharded(model_sharded_state_dict(model), Path(out_dir) / TORCH_DIST)


def convert_hf_to_torch_dist(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1,
                             seed: int = 0) -> dict:
    """Convert an HF directory to a Megatron torch_dist checkpoint; returns the manifest.

    Inside a distributed job of world size tp*pp every rank calls this; otherwise tp*pp local
    processes are spawned (gloo on CPU). An existing complete output with the same key is
    reused as is.
    """
    import torch.distributed as dist
    from transformers import AutoConfig

    from miles_core.training.megatron.model import model_shape, shutdown_parallel

    if pp != 1:
        raise NotImplementedError("pipeline parallel conversion (pp > 1) is not implemented")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    model_shape(AutoConfig.from_pretrained(hf_dir), tp)  # unsupported architectures fail here, fast
    digest = model_digest(hf_dir)
    key = conversion_key(digest, tp, pp)
    try:
        existing = verify_manifest(out_dir)
        if existing.get("key") == key:
            return existing
    except ValueError:
        pass
    in_job = dist.is_initialized()
    rank = dist.get_rank() if in_job else 0
    if rank == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
    if in_job:
        dist.barrier()
        _convert_rank(rank, dist.get_world_size(), str(hf_dir), str(out_dir), tp, pp, seed)
    elif tp * pp == 1:  # in this process, in a private world-size-1 group
        try:
            _convert_rank(0, 1, str(hf_dir), str(out_dir), tp, pp, seed)
        finally:
            shutdown_parallel(True)
    else:
        from miles_core.training.megatron.launch import run_spawned

        run_spawned(_convert_rank, tp * pp, str(hf_dir), str(out_dir), tp, pp, seed)
    manifest = None
    if rank == 0:
        import megatron.core

        copy_hf_meta(hf_dir, out_dir / HF_META)
        manifest = write_manifest(out_dir, format="megatron_torch_dist", key=key, source_digest=digest,
                                  layout={"tp": tp, "pp": pp}, converter_version=CONVERTER_VERSION,
                                  megatron_core_version=megatron.core.__version__)
    if in_job:
        dist.barrier()
        manifest = verify_manifest(out_dir)
    return manifest


def export_torch_dist_to_hf(ckpt_dir: str | Path, hf_dir_template: str | Path | None, out_dir: str | Path,
                            torch_dist_subdir: str = TORCH_DIST) -> Path:
    """An HF directory (config/tokenizer from the template, weights from the checkpoint).

    Works on converter outputs and on MegatronTrainer checkpoints (model tensors only) saved at
    any TP size; runs in this process at TP=1 (creating a private gloo group if needed).
    hf_dir_template=None uses the checkpoint's own `hf/` copy.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from miles_core.training.megatron import mapping
    from miles_core.training.megatron.model import build_gpt_model, init_parallel, model_shape, shutdown_parallel

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if (ckpt_dir / MANIFEST).is_file():
        verify_manifest(ckpt_dir)
    template = Path(hf_dir_template) if hf_dir_template is not None else ckpt_dir / HF_META
    hf_config = AutoConfig.from_pretrained(template)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    from megatron.core import parallel_state

    reuse = (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()
             and parallel_state.get_tensor_model_parallel_world_size() == 1)
    created = False if reuse else init_parallel(1)
    try:
        model = build_gpt_model(hf_config, 1, dtype=dtype)
        load_model_checkpoint(model, ckpt_dir / torch_dist_subdir)
        state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        hf_state = mapping.megatron_to_hf(state, model_shape(hf_config, 1))
    finally:
        if not reuse:
            shutdown_parallel(created)
    copy_hf_meta(template, out_dir)
    save_file(hf_state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
