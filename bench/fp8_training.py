"""FP8 training (training.fp8: torchao float8 linears) against the FSDP2 trainer as it runs today
(fp32 master weights, bf16 compute), same model, same GPU, same process.

    python bench/fp8_training.py [--model qwen3-0.6b-shape|qwen3-4b-shape] [--layers N] [--batch 4 8]
                                 [--seq 2048] [--steps 8] [--warmup 3] [--no-compile] [--out DIR]

On the lent GPU (torch 2.11; pydantic from tests/gpu/carry.py's `tools` set, torchao 0.18 from
its `megatron` set):

    sh tests/gpu/install.sh .whl/gpu/tools && sh tests/gpu/install.sh .whl/gpu/megatron
    PYTHONPATH=/tmp/site python bench/fp8_training.py --model qwen3-4b-shape --layers 8 --out /tmp/fp8

Both sides are FSDPTrainer's own sharding (miles_core.training.fsdp._shard with
training.fsdp.compute_dtype=bfloat16), its log-prob path (causal_lm_logprobs), grad clip and fused
AdamW: bf16 is `training.fp8=false`, fp8 is `training.fp8=true` (the decoder layers' linears as
torchao Float8Linear, dynamic tensorwise scales; lm_head and the embedding stay high precision).
Decoder layers are torch.compile'd on both sides (training.compile_decoder_layers=true): torchao's
float8 casts are only fast compiled. --layers keeps the shape's matmul sizes with fewer layers.

MFU counts 6 * params * tokens/s against the H100/H200 bf16 dense peak (989 TFLOP/s) for BOTH
sides, FP8 matmuls included: the FP8 side's figure is comparable with bf16's, not with FP8's
own (twice higher) peak. The last stdout line is the JSON summary; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from pathlib import Path

from _common import SHAPES, gpu_identity, log, rounded, start_gpu_bench

PEAK_BF16_FLOPS = 989e12


def build(shape: dict, layers: int, seq: int, fp8: bool, compile_layers: bool):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles_core.config.training import FSDPConfig
    from miles_core.training.fsdp import _shard

    config = Qwen3Config(**{**shape, "num_hidden_layers": layers}, max_position_embeddings=max(seq, 4096),
                         rope_theta=1e6, rms_norm_eps=1e-6, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    _shard(model, FSDPConfig(compute_dtype="bfloat16"), compile_layers, fp8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    params = sum(p.numel() for p in model.parameters())
    return model.train(), optimizer, params, config.vocab_size


def step(model, optimizer, tokens):
    import torch

    from miles_core.training.fsdp import causal_lm_logprobs

    logp, _ = causal_lm_logprobs(model, tokens, None, 1.0)
    loss = -logp.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure(model, optimizer, params: int, vocab: int, batch: int, seq: int, steps: int, warmup: int) -> dict:
    import torch

    tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(batch))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        started = time.perf_counter()
        losses = [step(model, optimizer, tokens) for _ in range(warmup)]
        warm_s = time.perf_counter() - started
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(step(model, optimizer, tokens))  # float(): synchronizes
            times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        return {"batch": batch, "oom": True}
    step_s = sorted(times)[len(times) // 2]
    tokens_per_s = batch * seq / step_s
    return {"batch": batch, "step_s": step_s, "tokens_per_s": tokens_per_s,
            "mfu_at_bf16_peak": 6 * params * tokens_per_s / PEAK_BF16_FLOPS, "warmup_s": warm_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "loss_first": losses[0], "loss_last": losses[-1]}


def run_side(args: argparse.Namespace, fp8: bool) -> dict:
    import torch

    name = "fp8" if fp8 else "bf16"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer, params, vocab = build(SHAPES[args.model], args.layers, args.seq, fp8, args.compile)
        runs = []
        for batch in args.batch:
            log(f"[fp8-training] {name} batch {batch}")
            runs.append(measure(model, optimizer, params, vocab, batch, args.seq, args.steps, args.warmup))
            log(f"[fp8-training] {name} {rounded(runs[-1])}")
    float8_linears = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return {"params": params, "float8_linears": float8_linears, "runs": runs,
            "warnings": sorted({str(w.message)[:200] for w in caught})}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3-4b-shape")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (the shape's matmul sizes kept)")
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    start_gpu_bench(__file__, args.out)
    from miles_core.training.fsdp import ensure_process_group

    ensure_process_group()
    sides = {name: run_side(args, fp8) for name, fp8 in (("bf16", False), ("fp8", True))}
    speedup = {str(b["batch"]): b["tokens_per_s"] / a["tokens_per_s"]
               for a, b in zip(sides["bf16"]["runs"], sides["fp8"]["runs"]) if "oom" not in a and "oom" not in b}
    from importlib.metadata import version

    summary = {"gpu": gpu_identity(), "torchao": version("torchao"), "model": args.model, "layers": args.layers,
               "seq": args.seq,
               "compiled": args.compile, "sides": sides, "fp8_over_bf16_tokens_per_s": speedup,
               "command": " ".join(["python", "bench/fp8_training.py", *(argv or sys.argv[1:])])}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_training.json").write_text(json.dumps(rounded(summary), indent=1))
    print(json.dumps(rounded(summary)))
    return summary


if __name__ == "__main__":
    main()
