"""Embedded engine generation throughput vs plain HF `generate`, same workload, same process.

    python bench/engine_throughput.py --model qwen3-0.6b-shape --num-seqs 1024 --new-tokens 256 --batch 256

Baseline: transformers `generate` with its default dynamic cache in batches of --batch (what a
trainer-side rollout does). Ours: EmbeddedEngine with --batch slots (on GPU: continuous
batching over a preallocated KV cache, compiled decode, log-probs from the decode step). Both
sample at temperature 1 and stop at the same stop tokens: --mean-length sets how many ids of the
vocabulary stop a sequence, with EOS on, so lengths vary (0: EOS off and none stop, every sequence
runs to --new-tokens). Tokens per second count generated tokens up to and including the stop.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import gpu_identity, kv_cache_shape

from miles_core.engines.embedded.engine import EmbeddedEngine
from miles_core.tiny import build_tokenizer

SHAPES = {
    "tiny": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=24, vocab_size=256),
    "qwen3-0.6b-shape": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def build_model(shape: str, out_dir: Path, dtype: torch.dtype) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(10, min(vocab, 90), (num, length), generator=g).tolist()


def hf_baseline(model, batch: list[list[int]], new_tokens: int, batch_size: int, pad_id: int,
                stop_ids: list[int]) -> tuple[float, int]:
    """Seconds and generated tokens of transformers' generate over `batch`, --batch rows at a time."""
    produced, started = 0, time.perf_counter()
    stops = torch.tensor(stop_ids or [-1], device=model.device)
    for start in range(0, len(batch), batch_size):
        ids = torch.tensor(batch[start : start + batch_size], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, max_new_tokens=new_tokens, pad_token_id=pad_id,  # top_k=0: the full softmax
                             eos_token_id=stop_ids or [model.config.vocab_size])  # no stop ids: none stops
        new = out[:, ids.shape[1]:]
        stopped = torch.isin(new, stops)
        first_stop = torch.where(stopped.any(-1), stopped.int().argmax(-1) + 1, new.shape[1])
        produced += int(first_stop.sum())
    sync()
    return time.perf_counter() - started, produced


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return round(time.perf_counter() - started, 3)


def engine_phases(engine: EmbeddedEngine, work: list[list[int]], params: dict) -> dict:
    """Seconds of the same generation with log-probs and seeds, without log-probs, and without
    seeds (transformers samples), then a kernel profile of the first to stderr."""
    phases = {
        "seeded_logprob_s": timed(lambda: engine.generate(work, params, return_logprob=True, seed=2)),
        "seeded_s": timed(lambda: engine.generate(work, params, return_logprob=False, seed=2)),
        "unseeded_s": timed(lambda: engine.generate(work, params, return_logprob=False)),
    }
    print(f"phases: {phases}", file=sys.stderr, flush=True)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        engine.generate(work, params, return_logprob=True, seed=3)
        sync()
    sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=60), file=sys.stderr)
    return phases


def stop_ids_for(mean_length: int, vocab: int) -> list[int]:
    """The top vocabulary ids, as many as make a uniform random model stop after ~mean_length tokens."""
    return [] if mean_length <= 0 else list(range(vocab - max(1, round(vocab / mean_length)), vocab))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256, help="rows per generate call, and the engine's slots")
    parser.add_argument("--mean-length", type=int, default=0, help="stop tokens for about this mean length (0: none)")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="the engine's KV cache size, as SGLang's flag (default: 40%% of the free memory)")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="SGLang's flag: block-FP8 decoder projections (rollout.precision=fp8)")
    parser.add_argument("--slot-decoding", action="store_true",
                        help="slot decoding even where the engine would not choose it (FP8 weights: opt-in)")
    parser.add_argument("--phases", action="store_true",
                        help="also time the engine without log-probs and without seeds, and print a profile "
                             "of its kernels to stderr")
    args = parser.parse_args()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    vocab = SHAPES[args.model]["vocab_size"]
    stop_ids = stop_ids_for(args.mean_length, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.model, Path(tmp) / "model", dtype)
        engine = EmbeddedEngine(str(model_dir), dtype=str(dtype).removeprefix("torch."), max_batch_size=args.batch,
                                mem_fraction_static=args.mem_fraction_static, quantization=args.quantization,
                                slot_decoding=True if args.slot_decoding else None)
        work = prompts(args.num_seqs, args.prompt_len, vocab)
        # EOS stays on with stop ids (SGLang's ignore_eos would turn stop_token_ids off too); the
        # baseline then stops at the same set: the stop ids and every EOS id of the model.
        params = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": not stop_ids,
                  "stop_token_ids": stop_ids}
        if stop_ids:
            stop_ids = [*stop_ids, *engine.eos_ids]
        print("warm-up (compilation)...", file=sys.stderr)
        engine.generate(work[: args.batch], params, return_logprob=True, seed=0)
        sync()
        print(f"KV cache: {kv_cache_shape(engine)}", file=sys.stderr)
        started = time.perf_counter()
        outs = engine.generate(work, params, return_logprob=True, seed=1)
        sync()
        ours = time.perf_counter() - started
        produced = sum(len(o["output_ids"]) for o in outs)
        phases = engine_phases(engine, work, params) if args.phases else {}
        print("baseline...", file=sys.stderr)
        hf_baseline(engine.model, work[: args.batch], 4, args.batch, engine.pad_id, stop_ids)  # warm-up
        base, base_produced = hf_baseline(engine.model, work, args.new_tokens, args.batch, engine.pad_id, stop_ids)
    print(json.dumps({
        "model": args.model, "quantization": args.quantization, "device": str(engine.device), **gpu_identity(),
        "num_seqs": args.num_seqs,
        "new_tokens": args.new_tokens,
        "batch": args.batch, "mean_length_target": args.mean_length, "slot_decoding": engine.slots is not None,
        "engine_mean_length": round(produced / len(outs), 1), "hf_mean_length": round(base_produced / len(work), 1),
        "engine_tokens_per_s": round(produced / ours), "hf_generate_tokens_per_s": round(base_produced / base),
        "speedup": round((produced / ours) / (base_produced / base), 2), **phases,
    }))


if __name__ == "__main__":
    main()
