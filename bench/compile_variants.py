"""MFU of the trainers' step under Inductor settings, against the trainers' default, in one run.

    python bench/compile_variants.py [--variants coordinate_descent ...] [--backends fsdp2_hf megatron]
                                     [--batch 16] [--seq 2048] [--steps 10] [--warmup 3] [--profile]
                                     [--out DIR] [--time-budget S]

The step, models and MFU are bench/megatron_mfu.py's (forward, fused log-probs, backward, grad clip,
fused AdamW; Qwen3-0.6B shape, bf16). Each variant recompiles the decoder layers and the log-prob
kernels from scratch (torch._dynamo.reset) under its settings:

  default                     torch.compile per decoder layer, as the trainers run it
  coordinate_descent          Inductor's coordinate-descent tuning of its Triton kernels' launch configs
  aggressive_fusion           Inductor fuses nodes even without shared reads
  max_autotune_no_cudagraphs  mode="max-autotune-no-cudagraphs" for the layers: matmul templates with
                              fused epilogues
  coordinate_descent_max_autotune  coordinate_descent and max_autotune_no_cudagraphs together
  logprobs_one_piece          the log-prob kernels over the whole micro-batch in one piece (int64
                              indexing) instead of chunks of under 2^31 logits

Variants alternate with the default (default, A, default, B, ...) so every ratio has a baseline
measured just before it in the same process. Progress goes to stderr; the last stdout line is the
JSON summary with each variant's MFU and its ratio to the default run next to it. GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import gpu_identity, log, rounded, start_gpu_bench

VARIANTS = {  # Inductor config patch, torch.compile mode of the layers, logits per compiled log-prob chunk
    "default": ({}, None, None),
    "coordinate_descent": ({"coordinate_descent_tuning": True}, None, None),
    "aggressive_fusion": ({"aggressive_fusion": True}, None, None),
    "max_autotune_no_cudagraphs": ({}, "max-autotune-no-cudagraphs", None),
    "coordinate_descent_max_autotune": ({"coordinate_descent_tuning": True}, "max-autotune-no-cudagraphs", None),
    "logprobs_one_piece": ({}, None, 1 << 62),
}


@contextlib.contextmanager
def inductor_settings(patch: dict):
    import torch._inductor.config as inductor_config

    with inductor_config.patch(patch):
        yield


def compile_layers(name: str, model, mode: str | None) -> None:
    """Per-layer torch.compile with the variant's mode, as the trainers' compile_decoder_layers
    does it (their dynamo cache limit included). The mode reaches the layers only: the log-prob
    kernels keep the trainers' own torch.compile call, under the variant's Inductor settings."""
    import torch
    import torch._dynamo

    layers = list(model.decoder.layers if name == "megatron" else model.model.layers)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(layers) + 8)
    for layer in layers:
        if name == "megatron":
            layer._compiled_call_impl = None
            layer.compile(mode=mode)
        else:
            layer.__dict__.pop("forward", None)
            layer.forward = torch.compile(layer.forward, mode=mode)


def build(backends: list[str], seq: int):
    """(config, models, optimizers, params): the HF model sharded as FSDPTrainer shards it and,
    when asked, a Megatron GPTModel with its weights; fused AdamW on each."""
    import torch
    from megatron_mfu import build_hf, build_megatron, hf_config, shard_as_fsdp_trainer

    config = hf_config(28, seq)
    hf_model = build_hf(config, torch.bfloat16)
    params = sum(p.numel() for p in hf_model.parameters())  # tied embedding counted once
    models = {"megatron": build_megatron(config, hf_model, torch.bfloat16)} if "megatron" in backends else {}
    shard_as_fsdp_trainer(hf_model)
    models["fsdp2_hf"] = hf_model
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True) for name, m in models.items()}
    return config, models, optimizers, params


def run_variant(variant: str, name: str, model, optimizer, config, params: int, args) -> dict:
    """Recompile from scratch under the variant's settings, then measure (and profile) one batch size."""
    import torch._dynamo
    from megatron_mfu import attention_flops_per_token, hf_step, measure, megatron_step, profile_step

    from miles_core.training import logprobs

    patch, mode, logprob_elements = VARIANTS[variant]
    step = megatron_step if name == "megatron" else hf_step
    torch._dynamo.reset()
    logprobs._COMPILED.clear()
    default_elements = logprobs.COMPILED_CHUNK_ELEMENTS
    logprobs.COMPILED_CHUNK_ELEMENTS = logprob_elements or default_elements
    try:
        with inductor_settings(patch):
            compile_layers(name, model, mode)
            row = measure(step, model, optimizer, args.batch, args.seq, config.vocab_size, args.steps, args.warmup,
                          params, attention_flops_per_token(config, args.seq))
            if args.profile and not row.get("oom"):
                row["profile"] = profile_step(step, model, optimizer, args.batch, args.seq, config.vocab_size,
                                              f"{name}_{variant}", args.out)
    finally:
        logprobs.COMPILED_CHUNK_ELEMENTS = default_elements
    log(f"{variant} {name}: " + ("OOM" if row.get("oom") else
                                 f"MFU {100 * row['mfu']:.2f}% step {1e3 * row['step_s']:.1f} ms, "
                                 f"compile + warm-up {row['warmup_s']:.0f} s"))
    return {"variant": variant, "backend": name, **row}


def ratios(rows: list[dict]) -> list[dict]:
    """Each variant's MFU against the default run of its backend just before it."""
    out = []
    for i, row in enumerate(rows):
        if row["variant"] == "default" or row.get("oom"):
            continue
        base = next((r for r in reversed(rows[:i]) if r["variant"] == "default" and r["backend"] == row["backend"]
                     and not r.get("oom")), None)
        if base:
            out.append({"variant": row["variant"], "backend": row["backend"], "mfu": row["mfu"],
                        "baseline_mfu": base["mfu"], "speedup": base["step_s"] / row["step_s"]})
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["coordinate_descent", "aggressive_fusion"],
                        choices=[v for v in VARIANTS if v != "default"])
    parser.add_argument("--backends", nargs="+", default=["fsdp2_hf", "megatron"], choices=["fsdp2_hf", "megatron"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="kernel breakdown of each variant's step")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--time-budget", type=float, default=0, help="seconds; skip what would start later")
    args = parser.parse_args(argv)
    began = start_gpu_bench(__file__, args.out)
    import torch

    from miles_core.training.megatron.model import init_parallel, shutdown_parallel

    created = init_parallel(1)  # nccl world of one: megatron's groups, and FSDP2's default group
    config, models, optimizers, params = build(args.backends, args.seq)
    rows = []
    for variant in [v for asked in args.variants for v in ("default", asked)]:
        for name in args.backends:
            if args.time_budget and time.perf_counter() - began > args.time_budget:
                log(f"time budget spent: {variant} {name} skipped")
                continue
            rows.append(run_variant(variant, name, models[name], optimizers[name], config, params, args))
    shutdown_parallel(created)
    summary = {"bench": "compile_variants", **gpu_identity(), "batch": args.batch,
               "seq": args.seq, "torch": torch.__version__, "ratios": ratios(rows),
               "runs": [{k: v for k, v in r.items() if k != "profile"} for r in rows],
               "profiles": [r["profile"] for r in rows if "profile" in r], "wall_s": time.perf_counter() - began}
    print(json.dumps(rounded(summary)), flush=True)
    return summary


if __name__ == "__main__":
    main()
