"""HF-named weights in either MoE expert layout, and the digest that compares them.

Trainers, rollout engines and the weight-sync transports all speak HF parameter names; this
module is what they share about them, so none of them imports another for it.
"""

from __future__ import annotations

import hashlib
import re

import torch

# MoE experts have two layouts under HF names: the checkpoint's one tensor per expert and
# projection (what save_pretrained writes and SGLang loads), and transformers 5 modules' fused
# `mlp.experts.gate_up_proj` [E, 2F, H] / `mlp.experts.down_proj` [E, H, F].
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_layout(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors split into the checkpoint's per-expert ones (views); others as given."""
    out = {}
    for name, tensor in named_tensors.items():
        if (m := _FUSED.match(name)) is None:
            out[name] = tensor
            continue
        for expert, weight in enumerate(tensor):
            prefix = f"{m.group(1)}.{expert}."
            if m.group(2) == "down_proj":
                out[prefix + "down_proj.weight"] = weight
            else:
                out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = weight.chunk(2)
    return out


def fused_layout(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors stacked into transformers 5's fused expert tensors; others as given."""
    out, experts = {}, {}
    for name, tensor in named_tensors.items():
        if (m := _PER_EXPERT.match(name)) is None:
            out[name] = tensor
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
    for prefix, by_index in experts.items():
        order = [by_index[i] for i in sorted(by_index)]
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]]) for e in order])
        out[prefix + ".down_proj"] = torch.stack([e["down_proj"] for e in order])
    return out


def weights_sha256(named_tensors: dict[str, torch.Tensor], names: list[str] | None = None) -> str:
    """Digest of the exact bytes of the named tensors (sorted by name): the equality check.
    Taken in the checkpoint layout, so fused and per-expert MoE weights digest alike."""
    named_tensors = checkpoint_layout(named_tensors)
    digest = hashlib.sha256()
    for name in sorted(names or named_tensors):
        tensor = named_tensors[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
