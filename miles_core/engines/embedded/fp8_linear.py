"""A linear layer holding its weight in block FP8 (miles_core.weight_sync.quantization's layout), for an
engine that generates with rollout.precision=fp8 itself: the embedded engine started with
SGLang's `--quantization fp8` swaps its decoder projections for these and quantizes every weight
it is sent (Fp8Weights.copy).

On a Hopper GPU (compute capability 9.0+, in/out features multiples of 128) the forward is one
FP8 GEMM (torch._scaled_mm with 128x128 weight scales and 1x128 activation scales, the form SGLang's
block-FP8 linears compute; tests/gpu/test_fp8_gemm.py checks it against the reference). Elsewhere it
dequantizes the weight and runs the matmul in the activations' dtype: the numerics of an FP8-weight
engine minus activation quantization, which lets CPU tests measure the log-prob gap FP8 weights
open against the trainer.
"""

from __future__ import annotations

import functools
import logging

import torch

from miles_core.weight_sync.quantization import (
    BLOCK,
    FP8_DTYPE,
    emulated_fp8_linear,
    is_quantized_weight,
    quantize_block_fp8,
    scaled_mm_block_fp8,
)

log = logging.getLogger(__name__)


def has_block_fp8_gemm(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> bool:
    """Whether torch._scaled_mm's block form computes a linear with this FP8 weight: a CUDA device
    of compute capability 9.0 or more, dimensions whole multiples of the blocks, and a probe of
    the GEMM on that device that matches the dequantized reference (checked once per device)."""
    out_features, in_features = weight.shape
    return (weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (9, 0)
            and block == BLOCK and out_features % block[0] == 0 and in_features % block[1] == 0
            and _block_fp8_gemm_works(weight.device))


@functools.cache
def _block_fp8_gemm_works(device: torch.device) -> bool:
    """torch._scaled_mm's block form at decode sizes (1 and 3 tokens) against the reference; a
    refusal or a mismatch is logged and the layers dequantize instead (slower, never silent)."""
    g = torch.Generator(device).manual_seed(0)
    w = torch.randn(256, 256, device=device, generator=g) * 0.02
    q, scale_inv = quantize_block_fp8(w)
    try:
        for tokens in (1, 3):
            x = torch.randn(tokens, 256, device=device, generator=g, dtype=torch.bfloat16)
            want = emulated_fp8_linear(x.float(), q, scale_inv)
            error = float((scaled_mm_block_fp8(x, q, scale_inv).float() - want).norm() / want.norm())
            if error > 1e-2:
                raise ValueError(f"relative error {error:.2e} at {tokens} tokens")
    except (RuntimeError, TypeError, ValueError) as exc:  # refused by this torch or GPU, or wrong
        log.warning("FP8 linears on %s dequantize to bf16 (several times slower): torch._scaled_mm's block "
                    "form failed its check: %s", device, exc)
        return False
    return True


class Fp8BlockLinear(torch.nn.Module):
    """y = x @ dequant(weight, weight_scale_inv).T + bias, the weight stored as float8_e4m3fn."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                 block: tuple[int, int] = BLOCK):
        super().__init__()
        # Buffers, not parameters: an engine never trains them, and optimizers must not see fp8 tensors.
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", weight_scale_inv)
        self.register_buffer("bias", bias)
        self.block = block
        self.out_features, self.in_features = weight.shape
        # Decided once, where the weight lives: a Python branch in forward, which torch.compile
        # specializes on, rather than a device query inside the compiled decode step.
        self.fp8_gemm = has_block_fp8_gemm(weight, block)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, block: tuple[int, int] = BLOCK) -> Fp8BlockLinear:
        q, scale_inv = quantize_block_fp8(linear.weight.detach(), block)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale_inv, bias, block)

    def load_quantized(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> None:
        """A weight sync: copy a new FP8 weight and its scales in place (shapes must match)."""
        self.weight.copy_(weight)
        self.weight_scale_inv.copy_(weight_scale_inv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_gemm:
            return scaled_mm_block_fp8(x, self.weight, self.weight_scale_inv, self.bias)
        return emulated_fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.block)


def swap_to_fp8_linears(model: torch.nn.Module, block: tuple[int, int] = BLOCK) -> list[str]:
    """Replace, in place, every nn.Linear whose `<name>.weight` SGLang's fp8 loader quantizes
    (decoder-layer projections) by an Fp8BlockLinear; returns the replaced module names."""
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and is_quantized_weight(f"{name}.weight"):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Fp8BlockLinear.from_linear(module, block))
            swapped.append(name)
    return swapped


class Fp8Weights:
    """Where a model's weights load once its projections are Fp8BlockLinears: a copy into an FP8
    weight quantizes the source block-wise (and sets that layer's scales), unless the source is
    already FP8 (a block-FP8 payload that brings its `weight_scale_inv` too). Every other tensor
    is copied as is. A plain cast into float8 would lose the scales: never done."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]

    def tensors(self) -> list[torch.Tensor]:
        """The FP8 layers' weight and scale buffers (what releasing the weights must free too)."""
        return [t for m in self.modules for t in (m.weight, m.weight_scale_inv)]

    def layer_of(self, tensor: torch.Tensor) -> Fp8BlockLinear | None:
        """The FP8 layer whose weight `tensor` is (or views: state_dict() detaches), else None."""
        if tensor.dtype != FP8_DTYPE:
            return None
        pointer = tensor.untyped_storage().data_ptr()
        return next((m for m in self.modules if m.weight.untyped_storage().data_ptr() == pointer), None)

    @torch.no_grad()
    def copy(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        plain_targets, plain_sources = [], []
        for target, source in zip(targets, sources):
            module = self.layer_of(target) if source.dtype != target.dtype else None
            if module is None:
                plain_targets.append(target)
                plain_sources.append(source)
            else:
                module.load_quantized(*quantize_block_fp8(source.to(target.device), module.block))
        if plain_targets:
            torch._foreach_copy_(plain_targets, plain_sources)
