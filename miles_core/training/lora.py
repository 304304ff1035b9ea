"""LoRA on the FSDP2 backend: peft injects the adapters into the HF model (names stay the HF
module paths, see miles_core.weight_sync.lora), everything else is frozen, and only the adapters
reach the optimizer. The sharded model keeps peft's names (`P.base_layer.weight`,
`P.lora_A.default.weight`); weights leave the trainer either merged (HF names, what exports,
checksums and full-weight transports carry) or as an adapter payload."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from miles_core.config.lora import LoRAConfig
from miles_core.weight_sync.lora import LORA_A, LORA_B, PEFT_PREFIX, merge_adapters, split_peft_state


def peft_config(cfg: LoRAConfig):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.modules,
                      bias="none", task_type="CAUSAL_LM")


def inject(model: torch.nn.Module, cfg: LoRAConfig) -> torch.nn.Module:
    """Adapters in place (B starts at zero: the model computes what the base did) and the base
    frozen: no gradients, so no optimizer states, for anything but A and B."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(peft_config(cfg), model)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_A." in name or ".lora_B." in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"training.lora.target_modules={cfg.target_modules} matched no linear layer of the model")
    return model


def adapter_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole (gathered) adapter parameters under peft's names, detached copies on their device.
    A collective when sharded: every rank calls it."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters() if p.requires_grad}


def adapter_payload(model: torch.nn.Module, cfg: LoRAConfig, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The adapter sync's tensors (HF module names, scale folded into B)."""
    params = adapter_params(model)
    if to_cpu:
        params = {k: v.cpu() for k, v in params.items()}
    return split_peft_state(params, cfg.scale)[1]


def merged_weights(state: dict[str, torch.Tensor], cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """A peft-named full state dict -> HF-named weights with the adapters merged in."""
    if not state:  # ranks other than 0 of a gather to the CPU
        return {}
    base, adapters = split_peft_state(state, cfg.scale)
    return base | merge_adapters(base, adapters)


def save_adapter(out_dir: Path, params: dict[str, torch.Tensor], cfg: LoRAConfig, base_model: str | None = None) -> Path:
    """The adapter folder in PEFT's layout (adapter_config.json, adapter_model.safetensors with
    `base_model.model.<P>.lora_A.weight`, B unscaled), loadable by PeftModel.from_pretrained;
    params: adapter_params' result."""
    tensors = {}
    for name, tensor in params.items():
        module, _, rest = name.rpartition(".lora_")  # rest: "A.default.weight"
        kind = rest[0]
        tensors[PEFT_PREFIX + module + (LORA_A if kind == "A" else LORA_B)] = tensor.cpu().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(cfg).to_dict()
    config["base_model_name_or_path"] = base_model
    config["target_modules"] = sorted(config["target_modules"])  # peft keeps a set
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1, default=str))
    return out_dir


def trainable_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts of the (possibly sharded) model."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
