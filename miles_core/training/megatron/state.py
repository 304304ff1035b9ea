"""torch_dist checkpoints of (model, torch AdamW) pairs, reshardable across TP sizes.

The optimizer's per-parameter tensors (exp_avg, exp_avg_sq) are described with the sharding
of the parameter they belong to (megatron.core.dist_checkpointing.optimizer helpers), so a
checkpoint written at TP=1 loads at TP=2 and back. Scalars (the Adam step, param groups,
scheduler) go to JSON through the caller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_core.training.megatron.convert import load_sharded, model_sharded_state_dict, save_sharded

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _extra_sharded(extra: dict[str, torch.Tensor]) -> dict:
    """TP-replicated tensors (e.g. a value head) as sharded tensors."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    return {name: make_sharded_tensor_for_checkpoint(tensor, name) for name, tensor in extra.items()}


def _params(optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _ensure_adam_state(optimizer) -> None:
    for p in _params(optimizer):
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in ADAM_KEYS:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def sharded_state(model, optimizer, extra: dict[str, torch.Tensor] | None = None) -> dict:
    """{'model': ..., 'extra': ..., 'optimizer': {key: {index: sharded tensor}}}."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
    )

    model_sd = model_sharded_state_dict(model)
    extra_sd = _extra_sharded(extra or {})
    out: dict[str, Any] = {"model": model_sd, "extra": extra_sd}
    if optimizer is None:
        return out
    _ensure_adam_state(optimizer)
    params = _params(optimizer)
    id_map = get_param_id_to_sharded_param_map({**model_sd, **extra_sd}, params)
    missing = [i for i in range(len(params)) if i not in id_map]
    if missing:
        raise RuntimeError(f"optimizer parameters {missing[:5]} have no sharding in the model state dict")
    out["optimizer"] = {key: {str(i): make_sharded_optimizer_tensor(id_map[i], optimizer.state[p][key],
                                                                    prefix=f"optimizer.state.{key}")
                              for i, p in enumerate(params)} for key in ADAM_KEYS}
    return out


def save(directory: str | Path, model, optimizer, extra: dict[str, torch.Tensor] | None = None) -> dict:
    """Write model (+extra, +optimizer moments) as torch_dist; returns the JSON-able remainder."""
    save_sharded(sharded_state(model, optimizer, extra), directory)
    if optimizer is None:
        return {}
    steps = {float(optimizer.state[p]["step"]) for p in _params(optimizer)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"adam_step": max(steps) if steps else 0.0, "param_groups": groups}


def load(directory: str | Path, model, optimizer, meta: dict | None,
         extra: dict[str, torch.Tensor] | None = None) -> None:
    """Fill model (+extra tensors in place, +optimizer) from a directory written by save()."""
    template = sharded_state(model, optimizer, extra)
    loaded = load_sharded(template, directory)
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not fit the model: missing={missing[:5]} unexpected={unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in (extra or {}).items():
            tensor.copy_(loaded["extra"][name])
    if optimizer is None:
        return
    params = _params(optimizer)
    with torch.no_grad():
        for key in ADAM_KEYS:
            for i, p in enumerate(params):
                optimizer.state[p][key].copy_(loaded["optimizer"][key][str(i)])
    for p in params:
        optimizer.state[p]["step"] = torch.tensor(float(meta["adam_step"]), dtype=torch.float32)
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
