"""Causal GQA attention, forward + backward, per kernel at the trainers' shape (Qwen3-0.6B: 16
query heads, 8 KV heads, head_dim 128; batch 16 x seq 2048, bf16), all in one process:

- `sdpa_default`: what the trainers run today (SDPA with torch's own backend choice);
- `sdpa_flash`, `sdpa_cudnn`: SDPA held to one backend;
- `sdpa_fa4`: SDPA's flash backend with FlashAttention-4 (flash-attn-4's CuTe DSL kernels)
  activated in the dispatcher by torch.nn.attention.activate_flash_attention_impl("FA4");
- `fa4_direct`: flash_attn.cute.flash_attn_func called on [b, s, h, d] tensors.

Each kernel's output and q/k/v gradients are compared with sdpa_default's on the same inputs;
a kernel that refuses the inputs, or is not installed, is reported with its error.

    python bench/attention_kernels.py [--batch 16] [--seq 2048] [--iters 10]

FA4 needs flash-attn-4 and nvidia-cutlass-dsl with its libs-base, libs-core and libs-cu13 (or
-cu12) wheels, installed in one pip call: `pip --target` replaces a shared top-level folder
per call. Outside site-packages its .pth is not read, so put
nvidia_cutlass_dsl/dsl_packages on PYTHONPATH too.

TFLOP/s counts causal attention as FlashAttention's papers do: forward 2 * b * h * s^2 * d
(QK^T and PV, causal half), backward 2.5x the forward. The last stdout line is one JSON object
with per-kernel ms and `ratio_vs_default` (sdpa_default ms / kernel ms). GPU only.
"""

from __future__ import annotations

import argparse
import json
import time

from _common import QWEN3_06B_SHAPE, gpu_identity, log, start_gpu_bench


def timed(run, iters: int) -> float:
    import torch

    for _ in range(3):  # JIT compilation and autotuning happen here
        run()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters * 1e3


def fwd_bwd(attention, q, k, v, grad):
    """One forward + backward into fresh gradients (no accumulation in the timed work)."""
    def run():
        for t in (q, k, v):
            t.grad = None
        out = attention(q, k, v)
        out.backward(grad)
        return out
    return run


def sdpa(backends=None):
    """SDPA held to `backends` (None: torch's own choice, as the trainers run it)."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def attention(q, k, v):
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return attention


def fa4_direct(q, k, v):
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def sdpa_fa4():
    """FA4 in the dispatcher from here on: SDPA's flash backend then runs flash-attn-4's kernels."""
    from torch.nn.attention import SDPBackend, activate_flash_attention_impl

    activate_flash_attention_impl("FA4")
    return sdpa([SDPBackend.FLASH_ATTENTION])


def kernels() -> dict:
    """name -> a maker of the attention function; sdpa_fa4 last, since activating FA4 swaps
    SDPA's flash kernel for the rest of the process."""
    from torch.nn.attention import SDPBackend

    return {"sdpa_default": sdpa, "sdpa_flash": lambda: sdpa([SDPBackend.FLASH_ATTENTION]),
            "sdpa_cudnn": lambda: sdpa([SDPBackend.CUDNN_ATTENTION]), "fa4_direct": lambda: fa4_direct,
            "sdpa_fa4": sdpa_fa4}


def measure(inputs, iters: int, forward_flops: float) -> dict[str, dict]:
    """Per kernel: fwd+bwd ms, TFLOP/s and the max abs difference of output and input
    gradients against sdpa_default's; a refused or missing kernel is reported by its error."""
    q, k, v, _ = inputs
    reference_out = fwd_bwd(sdpa(), *inputs)()
    reference = [reference_out.detach().clone()] + [t.grad.clone() for t in (q, k, v)]
    rows: dict[str, dict] = {}
    for name, make in kernels().items():
        try:
            run = fwd_bwd(make(), *inputs)
            out = run()
            diff = max(float((a.float() - b.float()).abs().max())
                       for a, b in zip([out.detach()] + [t.grad for t in (q, k, v)], reference))
            ms = timed(run, iters)
            rows[name] = {"fwd_bwd_ms": ms, "tflops": 3.5 * forward_flops / ms / 1e9, "max_abs_diff": diff}
        except Exception as exc:  # noqa: BLE001 - a refused or missing kernel is a result
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        log(f"{name}: {rows[name]}")
    for row in rows.values():
        if "fwd_bwd_ms" in row:
            row["ratio_vs_default"] = rows["sdpa_default"]["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=QWEN3_06B_SHAPE["num_attention_heads"])
    parser.add_argument("--kv-heads", type=int, default=QWEN3_06B_SHAPE["num_key_value_heads"])
    parser.add_argument("--head-dim", type=int, default=QWEN3_06B_SHAPE["head_dim"])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    start_gpu_bench(__file__)
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)

    def tensor(heads: int, grad: bool = True) -> torch.Tensor:
        shape = (args.batch, heads, args.seq, args.head_dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(grad)
    inputs = (tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads), tensor(args.heads, grad=False))
    shape = {"batch": args.batch, "seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
             "head_dim": args.head_dim}
    rows = measure(inputs, args.iters, 2 * args.batch * args.heads * args.seq ** 2 * args.head_dim)
    summary = {"bench": "attention_kernels", **gpu_identity(),
               "shape": shape, "kernels": rows}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
