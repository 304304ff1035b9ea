"""Checkpoint I/O of sharded modules as safetensors + JSON: no pickle on the load path.

For each named module: `<name>.safetensors` (full HF-named weights), `<name>_optimizer.safetensors`
(flattened optimizer tensors) and an entry in the JSON metadata (param groups, scheduler).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
LOAD_FULL = StateDictOptions(full_state_dict=True)


def full_weights(model: torch.nn.Module, drop_tied_head: bool = False, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded weights; to_cpu=False keeps them on the GPU (a device-to-device sync is
    ~100x faster than a round trip through host memory)."""
    state = get_model_state_dict(model, options=FULL if to_cpu else LOAD_FULL)
    if drop_tied_head:
        state.pop("lm_head.weight", None)
    return {k: v.contiguous() for k, v in state.items()}


def save_module(out_dir: Path, name: str, model, optimizer, scheduler, drop_tied_head: bool,
                write: bool = True) -> dict[str, Any]:
    """Write weights and optimizer tensors; return the JSON-able rest (param groups, scheduler).
    Gathering the shards is a collective: every rank calls this, one writes."""
    weights = full_weights(model, drop_tied_head)
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)
    if not write:
        return {}
    out_dir.mkdir(parents=True, exist_ok=True)
    weights_file = "model.safetensors" if name == "policy" else f"{name}.safetensors"
    save_file(weights, str(out_dir / weights_file))
    tensors = {f"{fqn}::{key}": torch.as_tensor(value).detach().cpu().contiguous()
               for fqn, entry in optim["state"].items() for key, value in entry.items()}
    save_file(tensors, str(out_dir / f"{name}_optimizer.safetensors"))
    return {"param_groups": optim["param_groups"],
            "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}}


def load_module(ckpt_dir: Path, name: str, model, optimizer, scheduler, meta: dict[str, Any], tied: bool) -> None:
    weights_file = "model.safetensors" if name == "policy" else f"{name}.safetensors"
    weights = load_file(str(ckpt_dir / weights_file))
    if tied and "model.embed_tokens.weight" in weights:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    set_model_state_dict(model, weights, options=LOAD_FULL)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(ckpt_dir / f"{name}_optimizer.safetensors")).items():
        fqn, _, field = key.rpartition("::")
        state.setdefault(fqn, {})[field] = value
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": meta["param_groups"]},
                             options=LOAD_FULL)
    scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})


def rng_state() -> tuple[dict[str, torch.Tensor], list]:
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state()}, [version, list(internal), gauss]


def set_rng_state(tensors: dict[str, torch.Tensor], python_state: list) -> None:
    torch.set_rng_state(tensors["torch"])
    version, internal, gauss = python_state
    random.setstate((version, tuple(internal), gauss))
