"""FP8 (e4m3) weight quantization for rollout engines that serve a model in FP8.

The layout is SGLang's (and DeepSeek-V3's) block-wise FP8 checkpoint format, which SGLang's
`Fp8LinearMethod` loads when the model's `quantization_config` has `quant_method: fp8` and
`weight_block_size: [128, 128]` (python/sglang/srt/layers/quantization/fp8.py):

- `<prefix>.weight`: float8_e4m3fn, the same [out, in] shape as the bf16 weight;
- `<prefix>.weight_scale_inv`: float32, [ceil(out / 128), ceil(in / 128)], one per 128x128 block.

Convention (checked against SGLang's `block_quant_dequant` in
python/sglang/srt/layers/quantization/fp8_utils.py, which returns `q.float() * scale` with the
scale repeated over each block): `weight_scale_inv` is the DEQUANTIZATION MULTIPLIER,
`w ~= q * weight_scale_inv`, i.e. amax(block) / 448. The name says "inverse" because it is the
inverse of the quantization factor 448 / amax that the weight was multiplied by.

Without a block size (`weight_block_size` absent), SGLang's fp8 linears take a per-tensor
`<prefix>.weight_scale` (float32, one value per fused shard), again a dequantization multiplier.
The per-channel option here ([out, 1] scales) is for the embedded engine and the tests; SGLang's
loader takes per-channel scales only from compressed-tensors checkpoints, not from `fp8`.

Everything runs on CPU (torch.float8_e4m3fn casts work there); only FP8 matmuls need a GPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = (128, 128)
# A block of zeros would give scale 0 and 0/0 on quantization; any positive floor works since
# such a block quantizes to zeros whatever its scale. Small enough not to touch real weights.
_MIN_SCALE = 1e-12

# The linear projections of a decoder layer in Hugging Face names (Llama, Qwen2/3, Mistral and
# their MoE experts): the layers SGLang's Fp8Config quantizes (every LinearBase not listed in
# ignored_layers). Embeddings (VocabParallelEmbedding), norms and lm_head (ParallelLMHead) are
# not LinearBase, so SGLang keeps them in the model dtype: they must stay bf16 in the payload.
_QUANTIZED = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|qkv_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj|gate_up_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")


def _blocks(n: int, size: int) -> int:
    return math.ceil(n / size)


def _pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pads a 2-D tensor to whole blocks: zeros never raise a block's amax, so the padding
    changes no scale, and it is cut off again after quantization."""
    rows, cols = w.shape
    pad_rows = _blocks(rows, block[0]) * block[0] - rows
    pad_cols = _blocks(cols, block[1]) * block[1] - cols
    return torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))


def _as_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[R*br, C*bc] -> [R, br, C, bc]: block (i, j) is [i, :, j, :]."""
    rows, cols = w.shape
    return w.view(rows // block[0], block[0], cols // block[1], block[1])


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (float8_e4m3fn weight of the same shape, float32 weight_scale_inv of
    shape [ceil(out/block0), ceil(in/block1)]) with `weight ~= q * scale_inv` blockwise.

    scale_inv = amax(|block|) / 448, so each block's largest element maps to +-448 exactly."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    # float32 for the arithmetic: bf16 would round amax/448 and the division a second time.
    blocks = _as_blocks(_pad_to_blocks(weight.float(), block), block)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=_MIN_SCALE) / FP8_MAX
    scaled = blocks / scale_inv[:, None, :, None]
    # The clamp guards rounding just above 448 (division in float32), which e4m3fn would turn into NaN.
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(scale_inv.shape[0] * block[0], scale_inv.shape[1] * block[1])[:rows, :cols]
    return q.contiguous(), scale_inv.contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_block_fp8`: each element times its block's scale_inv (as SGLang's
    block_quant_dequant does), in `dtype`."""
    rows, cols = q.shape
    expected = (_blocks(rows, block[0]), _blocks(cols, block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a {rows}x{cols} "
                         f"weight in {block[0]}x{block[1]} blocks: expected {expected}")
    full = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (q.float() * full[:rows, :cols]).to(dtype)


def quantize_channel_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: (float8 weight, float32 scale_inv of shape [out, 1]), one scale per row."""
    if weight.dim() != 2:
        raise ValueError(f"per-channel FP8 quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    scale_inv = w.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    return (w / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale_inv


def dequantize_channel_fp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_channel_fp8`."""
    return (q.float() * scale_inv.float()).to(dtype)


def is_quantized_weight(name: str) -> bool:
    """True for an HF name SGLang's fp8 loader expects in FP8: a decoder layer's linear
    projection weight. Biases, norms, embeddings and lm_head stay in the model dtype."""
    return bool(_QUANTIZED.search(name))


def fp8_quantization_config(block: tuple[int, int] = BLOCK) -> dict[str, Any]:
    """The `quantization_config` an engine's config.json needs for SGLang to build block-FP8
    linears (Fp8Config.from_config reads quant_method, activation_scheme and weight_block_size;
    block quantization requires the dynamic activation scheme)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block)}


def quantize_named_tensors(named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = BLOCK,
                           dtype: torch.dtype | None = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """An HF state dict's (name, tensor) pairs -> the pairs an engine serving the block-FP8
    layout loads: each linear projection weight becomes `<name>` (float8_e4m3fn) followed by
    `<prefix>.weight_scale_inv` (float32); every other tensor passes through in `dtype` (as it
    is with dtype=None).

    A generator, so a bucketed weight sync quantizes one bucket at a time."""
    for name, tensor in named:
        if is_quantized_weight(name) and tensor.dim() == 2:
            q, scale_inv = quantize_block_fp8(tensor, block)
            yield name, q
            yield name[: -len("weight")] + "weight_scale_inv", scale_inv
        else:
            yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def emulated_fp8_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                        bias: torch.Tensor | None = None, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias) in x's dtype: what an FP8 linear computes, up to the
    activation rounding a real FP8 GEMM (torch._scaled_mm) adds. The CPU stand-in and the
    reference the GPU path is checked against."""
    w = dequantize_block_fp8(q, scale_inv, block, dtype=x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def quantize_token_groups_fp8(x: torch.Tensor, group: int = BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (float8_e4m3fn [M, K], float32 dequantization multipliers [M, K / group]),
    one per 1 x `group` slice of a row: how SGLang's block-FP8 linears quantize their input."""
    rows, cols = x.shape
    if cols % group:
        raise ValueError(f"per-token FP8 groups of {group} need a multiple of {group} columns, got {cols}")
    groups = x.float().view(rows, cols // group, group)
    scale_inv = groups.abs().amax(-1).clamp(min=_MIN_SCALE) / FP8_MAX
    q = (groups / scale_inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, cols), scale_inv


def scaled_mm_block_fp8(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias) as one FP8 GEMM on Hopper: x quantized per token in 1x128 groups, W the
    block-FP8 weight (128x128 scales). torch._scaled_mm's (BlockWise1x128, BlockWise128x128) form
    takes the activation scales [M, K/128] outer-dim-major and the weight's as [K/128, N/128].
    Needs in/out features that are multiples of 128 and a CUDA device of compute capability 9.0."""
    lead = x.shape[:-1]
    xq, x_scale_inv = quantize_token_groups_fp8(x.reshape(-1, x.shape[-1]))
    out = torch._scaled_mm(xq, q.t(), x_scale_inv.t().contiguous().t(), scale_inv.t(), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, q.shape[0])


def weight_bytes(n_quantized: int, n_other: int, shapes: Iterable[tuple[int, int]] = (),
                 block: tuple[int, int] = BLOCK, other_bytes: int = 2) -> int:
    """Bytes of a model whose `n_quantized` linear elements are FP8 (1 B each, plus one float32
    scale per block of each shape in `shapes`) and `n_other` elements stay at `other_bytes`."""
    scales = sum(_blocks(r, block[0]) * _blocks(c, block[1]) for r, c in shapes)
    return n_quantized + 4 * scales + other_bytes * n_other
