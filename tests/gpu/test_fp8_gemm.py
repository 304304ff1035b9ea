"""Which of torch's FP8 GEMM calls computes the embedded engine's block-FP8 linear (128x128 weight
blocks, 1x128 activation groups) on this GPU, how close it is to the dequantized reference
(emulated_fp8_linear, what the engine runs today) and how fast against bf16 (issue 45; not in CI).

    python3 -m pytest tests/gpu/test_fp8_gemm.py -s

Each call form is tried; the ones torch refuses are reported with its message. The test asserts
that at least one form matches the reference, so the engine can use it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from miles_core.weight_sync.quantization import (
    emulated_fp8_linear,
    quantize_block_fp8,
    quantize_token_groups_fp8,
    scaled_mm_block_fp8,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or
                                                  torch.cuda.get_device_capability() < (9, 0), reason="needs Hopper")]
SHAPES = [(256, 1024, 3072), (256, 3072, 1024), (64, 2560, 9728)]  # (tokens, in, out): 0.6B and 4B MLPs


def reference(xq, xs, wq, ws) -> torch.Tensor:
    x = (xq.float().view(xq.shape[0], -1, 128) * xs[..., None]).view(xq.shape)
    w = wq.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)[: wq.shape[0], : wq.shape[1]]
    return x @ w.t()


def call_forms(xq, xs, wq, ws) -> dict:
    col_major = xs.t().contiguous().t()  # "outer-dim-major": the layout cuBLAS's block scales take
    forms = {
        "scaled_mm_block_fp8 (the library's form)": lambda: scaled_mm_block_fp8(xq.float().view(xq.shape[0], -1, 128)
                                                                             .mul(xs[..., None]).view(xq.shape)
                                                                             .to(torch.bfloat16), wq, ws),
        "_scaled_mm(a_scale col-major [M,K/128], w_scale.t())":
            lambda: torch._scaled_mm(xq, wq.t(), col_major, ws.t(), out_dtype=torch.bfloat16),
        "_scaled_mm(a_scale row-major, w_scale.t())":
            lambda: torch._scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=torch.bfloat16),
        "_scaled_mm(a_scale col-major, w_scale.t().contiguous())":
            lambda: torch._scaled_mm(xq, wq.t(), col_major, ws.t().contiguous(), out_dtype=torch.bfloat16),
    }
    if hasattr(torch.nn.functional, "scaled_mm"):
        from torch.nn.functional import ScalingType, scaled_mm

        forms["F.scaled_mm(BlockWise1x128, BlockWise128x128)"] = lambda: scaled_mm(
            xq, wq.t(), col_major, ScalingType.BlockWise1x128, ws.t(), ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16)
    return forms


def timed(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / reps * 1e6


def test_a_block_fp8_gemm_matches_the_dequantized_reference():
    print(f"[fp8-gemm] {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    working = []
    for m, k, n in SHAPES:
        g = torch.Generator("cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        wq, ws = quantize_block_fp8(w)
        xq, xs = quantize_token_groups_fp8(x)
        ref = reference(xq, xs, wq, ws)
        w_bf16 = w.bfloat16()
        bf16_us = timed(lambda x=x, w=w_bf16: torch.nn.functional.linear(x, w))
        emulated_us = timed(lambda x=x, wq=wq, ws=ws: emulated_fp8_linear(x, wq, ws))
        print(f"[fp8-gemm] {m}x{k}x{n}: bf16 {bf16_us:.1f} us, dequantize+bf16 {emulated_us:.1f} us")
        for name, fn in call_forms(xq, xs, wq, ws).items():
            try:
                out = fn()
            except Exception as exc:  # noqa: BLE001  (a refused form is a finding, reported)
                print(f"[fp8-gemm]   {name}: refused: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            rel = float((out.float() - ref).norm() / ref.norm())
            print(f"[fp8-gemm]   {name}: rel err {rel:.2e}, {timed(fn):.1f} us")
            if rel < 1e-2:
                working.append((m, k, n, name))
    assert working, "no FP8 GEMM form matched the block-FP8 reference"


@pytest.mark.parametrize("tokens", [1, 3, 8, 64, 256])
def test_the_engines_fp8_linear_runs_one_fp8_gemm_at_every_decode_size(tokens):
    """Fp8BlockLinear (what an embedded engine with quantization=fp8 runs) takes the FP8 GEMM on
    Hopper, eager and compiled, at slot counts from 1 up, and matches the dequantized reference."""
    from miles_core.engines.embedded.fp8_linear import Fp8BlockLinear

    g = torch.Generator("cuda").manual_seed(tokens)
    linear = torch.nn.Linear(2560, 9728, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, device="cuda", generator=g) * 0.02)
    layer = Fp8BlockLinear.from_linear(linear)
    assert layer.fp8_gemm
    x = torch.randn(tokens, 1, 2560, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = emulated_fp8_linear(x, layer.weight, layer.weight_scale_inv)
    for name, fn in (("eager", layer), ("compiled", torch.compile(layer, dynamic=False))):
        out = fn(x)
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        print(f"[fp8-linear] {torch.cuda.get_device_name()}, torch {torch.__version__}: {tokens} tokens {name}: "
              f"rel err {rel:.2e}, {timed(lambda f=fn: f(x)):.1f} us, "
              f"bf16 {timed(lambda: linear(x)):.1f} us")
        assert out.shape == (tokens, 1, 9728) and rel < 1e-2
