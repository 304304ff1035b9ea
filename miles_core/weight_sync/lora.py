"""LoRA adapter weights between the trainer (peft) and the engines, under Hugging Face names.

An adapter sync carries, for each adapted linear layer `P` (an HF module path such as
`model.layers.0.self_attn.q_proj`), two tensors: `P.lora_A.weight` (r x in) and
`P.lora_B.weight` (out x r) with the scale alpha / r already folded into B, so the payload alone
defines the layer's weight: W = W_base + B @ A. Both sides merge with `merge_adapters`, the
same arithmetic, so a trainer's merged weights and an engine's are the same bytes.

Engines merge into their own weights instead of running LoRA layers: decoding then costs what
the base model costs (no extra low-rank matmuls per token, nothing for the slot decoder or
torch.compile to learn about), at the price of keeping an unmerged copy of the adapted weights
(`AdapterMerger`) so that each sync re-merges from the base rather than on top of the last merge.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
PEFT_PREFIX = "base_model.model."  # what peft's save_pretrained puts before the HF module path


def is_adapter_payload(tensors: dict[str, torch.Tensor]) -> bool:
    """True when every name is an adapter factor (a sync that carries adapters only)."""
    return bool(tensors) and all(n.endswith((LORA_A, LORA_B)) for n in tensors)


def adapted_modules(adapters: dict[str, torch.Tensor]) -> list[str]:
    """The HF module paths a payload adapts, in its order."""
    return [n.removesuffix(LORA_A) for n in adapters if n.endswith(LORA_A)]


@torch.no_grad()
def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`P.weight` -> W_base + B @ A for every adapted module P, in float32, cast back to the base's
    dtype (a bf16 engine rounds once, after the sum)."""
    merged = {}
    for module in adapted_modules(adapters):
        weight = base[f"{module}.weight"]
        a, b = adapters[module + LORA_A], adapters[module + LORA_B]
        delta = b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)
        merged[f"{module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def split_peft_state(state: dict[str, torch.Tensor], scale: float,
                     adapter: str = "default") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A peft-injected model's state dict -> (base weights under HF names, adapter payload with B
    scaled). peft renames an adapted layer's weight to `P.base_layer.weight` and adds
    `P.lora_A.<adapter>.weight` / `P.lora_B.<adapter>.weight`."""
    base, adapters = {}, {}
    for name, tensor in state.items():
        if name.endswith(f".lora_A.{adapter}.weight"):
            adapters[name.removesuffix(f".lora_A.{adapter}.weight") + LORA_A] = tensor
        elif name.endswith(f".lora_B.{adapter}.weight"):
            adapters[name.removesuffix(f".lora_B.{adapter}.weight") + LORA_B] = tensor * scale
        else:
            base[name.replace(".base_layer.", ".")] = tensor
    return base, adapters


def read_peft_adapter(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT adapter folder (what miles_core.training.lora.save_adapter writes, or any
    `save_pretrained` of a LoRA model) -> (its adapter_config.json, the adapter payload: HF module
    names, the scale lora_alpha / r (rsLoRA: / sqrt(r)) folded into B). ValueError saying what is
    wrong with a folder that is not such an adapter."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder} is not a PEFT adapter folder (adapter_config.json, "
                         f"adapter_model.safetensors): {type(exc).__name__}: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"{folder}: only plain LoRA adapters are served (peft_type LORA, no DoRA)")
    rank = int(config["r"])
    scale = float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    payload = {}
    for name, tensor in tensors.items():
        if not name.endswith((LORA_A, LORA_B)):
            raise ValueError(f"{folder}: {name!r} is not a LoRA factor (*{LORA_A} or *{LORA_B})")
        payload[name.removeprefix(PEFT_PREFIX)] = tensor * scale if name.endswith(LORA_B) else tensor
    return config, payload


def payload_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterMerger:
    """An engine's unmerged copy of the weights that adapters touch, taken at the first adapter
    sync (the base the engine was loaded or fully synced with); each sync merges from it."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    def merged(self, live: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-named full weights to load for this payload; `live` is the engine's state dict."""
        for module in adapted_modules(adapters):
            name = f"{module}.weight"
            if name not in self.base:
                if name not in live:
                    raise KeyError(f"adapter for {module!r}, which the engine's model does not have")
                self.base[name] = live[name].detach().clone()
        return merge_adapters(self.base, adapters)

    def forget(self) -> None:
        """A full-weight update replaced the base: the next adapter sync copies it again."""
        self.base.clear()
