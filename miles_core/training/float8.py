"""training.fp8: the FSDP2 trainer's decoder-layer linears as torchao Float8Linear (FP8 matmuls
with dynamic per-tensor scales; master weights, gradients and Adam states keep their dtype).

GPU only: FP8 tensor-core matmuls exist from compute capability 8.9 (Ada, Hopper). On the CPU
the conversion refuses with NotImplementedError instead of training in a precision it cannot
compute. torchao is optional (not a dependency of this project): installed on GPU nodes only.
"""

from __future__ import annotations

import re

import torch

# Decoder-layer projections only: the embedding is no Linear, and lm_head (and a critic's value
# head) stay in high precision, where FP8 rounding of the logits would show in every log-prob.
_LAYER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.")
MIN_CAPABILITY = (8, 9)


def float8_filter(module: torch.nn.Module, fqn: str) -> bool:
    """torchao's module_filter_fn: a decoder layer's nn.Linear whose both dimensions are
    multiples of 16 (what FP8 GEMMs (torch._scaled_mm) require)."""
    return (isinstance(module, torch.nn.Linear) and bool(_LAYER_LINEAR.search(fqn))
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_float8_linears(model: torch.nn.Module, device: torch.device) -> int:
    """Swap the filtered linears for Float8Linear in place (before fully_shard); returns how many."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        raise NotImplementedError(f"training.fp8 needs FP8 matmuls, which {device} does not have (CUDA compute "
                                  f"capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, Hopper or newer): "
                                  "set training.fp8=false")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise RuntimeError("training.fp8 uses torchao's float8 linears: install torchao in the trainer's "
                           "environment (pip install torchao) or set training.fp8=false") from exc
    names = [name for name, module in model.named_modules() if float8_filter(module, name)]
    convert_to_float8_training(model, module_filter_fn=float8_filter)
    return len(names)
