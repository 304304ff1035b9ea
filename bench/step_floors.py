"""The floors under a Qwen3-0.6B-shaped training step on this GPU, measured, in one run.

    python bench/step_floors.py [--tokens 32768]

- HBM bandwidth: a bf16 copy and an add (a + b -> c) over 1 GiB tensors, bytes moved / time.
- The fused log-prob pass over tokens x 152k vocab logits (forward + backward, as both trainers
  run it): in chunks of under 2^31 logits (the default; int32 indexing) against one piece (the
  whole micro-batch; int64 indexing), with the bytes it must move over the copy bandwidth.
- The decoder layer's projections at tokens x hidden, forward + backward (three matmuls each),
  as separate matmuls (HF's q/k/v and gate/up) and as one fused matmul (megatron's linear_qkv and
  linear_fc1), with TFLOP/s against the 989 TF/s bf16 dense peak.

Prints one JSON line. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QWEN3_06B_SHAPE, gpu_identity, log, rounded, start_gpu_bench
from megatron_mfu import PEAK_FLOPS


def timed_ms(fn, iterations: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def bandwidth() -> dict:
    import torch

    n = 1 << 29  # 1 GiB of bf16
    a, b, c = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    copy_ms = timed_ms(lambda: c.copy_(a))
    add_ms = timed_ms(lambda: torch.add(a, b, out=c))
    return {"copy_tb_per_s": 2 * 2 * n / copy_ms / 1e9, "add_tb_per_s": 3 * 2 * n / add_ms / 1e9}


def logprob_pass(tokens: int, copy_tb_per_s: float) -> dict:
    import torch

    from miles_core.training.logprobs import token_logprobs

    vocab = QWEN3_06B_SHAPE["vocab_size"]
    logits = torch.randn(1, tokens, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), device="cuda")
    weights = torch.rand(1, tokens, device="cuda")

    def step(chunk):
        logits.grad = None
        logp, _ = token_logprobs(logits, targets, 1.0, vocab, chunk_tokens=chunk)
        (logp * weights).sum().backward()

    floor_ms = 3 * logits.numel() * 2 / (copy_tb_per_s * 1e12) * 1e3  # read (fwd), read + write (bwd)
    chunked_ms, whole_ms = timed_ms(lambda: step(None), 10), timed_ms(lambda: step(tokens), 10)
    log(f"log-prob pass: chunked {chunked_ms:.2f} ms, one piece {whole_ms:.2f} ms, floor {floor_ms:.2f} ms")
    return {"chunked_ms": chunked_ms, "one_piece_ms": whole_ms, "bandwidth_floor_ms": floor_ms,
            "one_piece_over_chunked": whole_ms / chunked_ms}


def projections(tokens: int) -> list[dict]:
    """fwd + bwd of x @ W^T for each group of output widths, separate vs concatenated."""
    import torch

    h = QWEN3_06B_SHAPE["hidden_size"]
    q = QWEN3_06B_SHAPE["num_attention_heads"] * QWEN3_06B_SHAPE["head_dim"]
    kv = QWEN3_06B_SHAPE["num_key_value_heads"] * QWEN3_06B_SHAPE["head_dim"]
    inter = QWEN3_06B_SHAPE["intermediate_size"]
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    rows = []
    for label, widths in (("qkv", [q, kv, kv]), ("gate_up", [inter, inter]), ("o_proj", [h]),
                          ("down_proj (in=intermediate)", None)):
        if widths is None:  # down: intermediate -> hidden
            xi = torch.randn(tokens, inter, device="cuda", dtype=torch.bfloat16)
            groups = {"single": [torch.randn(h, inter, device="cuda", dtype=torch.bfloat16)]}
        else:
            xi = x
            weights = [torch.randn(w, h, device="cuda", dtype=torch.bfloat16) for w in widths]
            groups = {"separate": weights, "fused": [torch.cat(weights)]} if len(widths) > 1 else {"single": weights}
        for kind, ws in groups.items():
            grads = [torch.randn(tokens, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]

            def step(ws=ws, grads=grads, xi=xi):
                dx = None
                for w, g in zip(ws, grads):
                    xi @ w.t()
                    part = g @ w
                    dx = part if dx is None else dx + part
                    g.t() @ xi
                return dx

            ms = timed_ms(step)
            flops = sum(6 * tokens * w.shape[0] * w.shape[1] for w in ws)
            rows.append({"matmuls": label, "kind": kind, "fwd_bwd_ms": ms, "tflops": flops / ms / 1e9,
                         "of_peak": flops / ms / 1e-3 / PEAK_FLOPS})
            log(f"{label} {kind}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TF/s")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    start_gpu_bench(__file__)

    setup = bandwidth()
    result = {"bench": "step_floors", **gpu_identity(), "tokens": args.tokens,
              "bandwidth": setup, "logprob_pass": logprob_pass(args.tokens, setup["copy_tb_per_s"]),
              "projections": projections(args.tokens)}
    print(json.dumps(rounded(result)), flush=True)


if __name__ == "__main__":
    main()
