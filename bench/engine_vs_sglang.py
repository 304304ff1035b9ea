"""The embedded engine against a real SGLang server: same GPU, model, prompts and settings.

    python bench/engine_vs_sglang.py --sglang-python /tmp/sgl-python --model qwen3-0.6b-shape \
        --num-seqs 1024 --new-tokens 256 --batch 256

Both sample at temperature 1 with log-probs on, at most --batch sequences running, and a KV cache
of --mem-fraction-static; each is timed twice: with EOS on (stop ids chosen so that a random model
stops after about --mean-length tokens, lengths vary) and off (every sequence runs --new-tokens).
SGLang runs as `miles run` starts it (SGLangLauncher, HTTP, the recipe's server args), not in its
fastest configuration: the carried kernel wheel has no FA3, so triton attention. The embedded engine
is called in-process, without the HTTP server `miles run` puts in front of it (one batch per
workload, so the HTTP cost left out is one request). Tokens per second count generated tokens,
including the stop. SGLang is timed first, then stopped, then the embedded engine runs in this
process. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import gpu_identity, log, start_gpu_bench


def workloads(args, vocab: int) -> dict[str, dict]:
    from engine_throughput import stop_ids_for

    stop_ids = stop_ids_for(args.mean_length, vocab)
    return {"eos_on": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "stop_token_ids": stop_ids},
            "eos_off": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}}


def time_sglang(args, model_dir: Path, prompts: list[list[int]], loads: dict[str, dict]) -> dict:
    from miles_core.engines.sglang.client import SGLangLauncher

    server_args = {"dtype": "bfloat16", "attention_backend": "triton", "sampling_backend": "pytorch",
                   "grammar_backend": "none", "mem_fraction_static": args.mem_fraction_static,
                   "max_running_requests": args.batch, "skip_server_warmup": True}
    launcher = SGLangLauncher(model_dir, server_args, python=args.sglang_python, log_path=args.work / "sglang.log",
                              startup_timeout=1800)
    started = time.perf_counter()
    client = launcher.start()
    log(f"SGLang healthy in {time.perf_counter() - started:.0f} s")
    rates: dict = {"version": client.server_info().get("version")}
    try:
        for name, params in loads.items():
            client.generate(prompts[:args.batch], params)  # warm-up: CUDA graphs, caches
            started = time.perf_counter()
            out = client.generate(prompts, params, return_logprob=True)
            seconds = time.perf_counter() - started
            produced = sum(len(r["meta_info"]["output_token_logprobs"]) for r in out)
            rates[name] = {"tokens_per_s": round(produced / seconds), "mean_length": round(produced / len(out), 1)}
            log(f"SGLang {name}: {rates[name]}")
    finally:
        launcher.stop()
    return rates


def time_embedded(args, model_dir: Path, prompts: list[list[int]], loads: dict[str, dict]) -> dict:
    import torch

    from miles_core.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(model_dir), dtype="bfloat16", max_batch_size=args.batch,
                            mem_fraction_static=args.mem_fraction_static)
    rates = {"slot_decoding": engine.slots is not None}
    for name, params in loads.items():
        engine.generate(prompts[:args.batch], params, return_logprob=True, seed=0)  # warm-up: compile, graphs
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = engine.generate(prompts, params, return_logprob=True, seed=1)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        produced = sum(len(o["output_ids"]) for o in out)
        rates[name] = {"tokens_per_s": round(produced / seconds), "mean_length": round(produced / len(out), 1)}
        log(f"embedded {name}: {rates[name]}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-python", required=True, help="an interpreter that has SGLang (rollout.engine.python)")
    parser.add_argument("--model", default="qwen3-0.6b-shape", choices=["tiny", "qwen3-0.6b-shape"])
    parser.add_argument("--num-seqs", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256, help="sequences running at once on both engines")
    parser.add_argument("--mean-length", type=int, default=128, help="EOS-on workload: about this mean length")
    parser.add_argument("--mem-fraction-static", type=float, default=0.6)
    args = parser.parse_args()
    start_gpu_bench(__file__)
    import torch
    from engine_throughput import SHAPES, build_model, prompts

    with tempfile.TemporaryDirectory() as tmp:
        args.work = Path(tmp)
        model_dir = build_model(args.model, args.work / "model", torch.bfloat16)
        vocab = SHAPES[args.model]["vocab_size"]
        work, loads = prompts(args.num_seqs, args.prompt_len, vocab), workloads(args, vocab)
        sglang = time_sglang(args, model_dir, work, loads)
        embedded = time_embedded(args, model_dir, work, loads)
    print(json.dumps({
        "bench": "engine_vs_sglang", **gpu_identity(), "model": args.model, "num_seqs": args.num_seqs,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": args.batch,
        "mem_fraction_static": args.mem_fraction_static, "sglang": sglang, "embedded": embedded,
        "embedded_over_sglang": {k: round(embedded[k]["tokens_per_s"] / sglang[k]["tokens_per_s"], 3) for k in loads},
    }), flush=True)


if __name__ == "__main__":
    main()
