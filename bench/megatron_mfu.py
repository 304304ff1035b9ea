"""Training throughput and MFU: Megatron backend (local spec, SDPA core attention) vs the
FSDP2 / HF+SDPA path, same random Qwen3-0.6B-shaped model, same GPU, same run.

    python bench/megatron_mfu.py [--batch 2 8] [--seq 2048] [--steps 10] [--warmup 3] [--layers 28]

One step = forward + token log-probs of every next token (the trainers' loss path: Megatron
through miles_core's chunked vocab-parallel cross entropy, HF through log_softmax of fp32
logits as FSDPTrainer does) + backward + grad clip + AdamW. Parameters and optimizer state
are bf16 on both sides. The two backends alternate per batch size. tokens/s counts
batch * seq per step; MFU = 6 * params * tokens/s / 989e12 (H200 bf16 dense peak).
Progress goes to stderr; the last stdout line is the JSON result. GPU only.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QWEN3_06B_SHAPE, log, rounded, setup_env, stub_ray_if_missing  # noqa: E402

PEAK_FLOPS = 989e12


def hf_config(layers: int, seq: int):
    from transformers import Qwen3Config

    shape = {**QWEN3_06B_SHAPE, "num_hidden_layers": layers}
    return Qwen3Config(**shape, max_position_embeddings=max(seq, 4096), rope_theta=1e6, rms_norm_eps=1e-6,
                       architectures=["Qwen3ForCausalLM"])


def build_hf(config, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    except TypeError:  # older transformers
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    return model.cuda().train()


def build_megatron(config, hf_model, dtype, fused_swiglu: bool = False):
    """GPTModel with the HF model's weights (so both start from the same point)."""
    from miles_core.training.megatron import mapping
    from miles_core.training.megatron.model import build_gpt_model, model_shape

    model = build_gpt_model(config, 1, dtype=dtype, fused_swiglu=fused_swiglu).train()
    state = mapping.hf_to_megatron_rank({k: v.detach() for k, v in hf_model.state_dict().items()},
                                        model_shape(config, 1), 1, 0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return model


def megatron_step(model, optimizer, tokens, vocab_size: int):
    from miles_core.training.megatron.logprobs import clip_grad_norm, next_token_logprobs
    from miles_core.training.megatron.model import forward_logits

    logp, _ = next_token_logprobs(forward_logits(model, tokens), tokens, 1.0, vocab_size)
    loss = -logp.mean()
    loss.backward()
    clip_grad_norm(list(model.parameters()), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def hf_step(model, optimizer, tokens, vocab_size: int):
    import torch

    logits = model(input_ids=tokens).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    loss = -logp.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def measure(step, model, optimizer, batch: int, seq: int, vocab: int, steps: int, warmup: int,
            params: int) -> dict:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(batch)
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(warmup):
            step(model, optimizer, tokens, vocab)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            loss = step(model, optimizer, tokens, vocab)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    except torch.cuda.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return {"batch": batch, "oom": True}
    tokens_per_s = batch * seq * steps / seconds
    return {"batch": batch, "tokens_per_s": tokens_per_s, "mfu": 6 * params * tokens_per_s / PEAK_FLOPS,
            "step_s": seconds / steps, "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
            "loss": float(loss)}


def logits_agreement(hf_model, mg_model, vocab: int) -> float:
    import torch

    from miles_core.training.megatron.model import forward_logits

    tokens = torch.randint(0, vocab, (1, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        a = hf_model(input_ids=tokens).logits.float()
        b = forward_logits(mg_model, tokens)[..., :vocab].float()
    return float((a - b).abs().max() / a.abs().max())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=QWEN3_06B_SHAPE["num_hidden_layers"])
    parser.add_argument("--fused-swiglu", action="store_true", help="megatron's torch.compile'd SwiGLU")
    args = parser.parse_args(argv)
    setup_env()
    stub_ray_if_missing()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/megatron_mfu.py needs a GPU")
    import megatron.core
    import transformers
    from torch.distributed.fsdp import fully_shard

    from miles_core.training.megatron.model import init_parallel, shutdown_parallel

    torch.backends.cuda.matmul.allow_tf32 = True
    dtype = torch.bfloat16
    created = init_parallel(1)  # nccl world of one: megatron's groups, and FSDP2's default group
    config = hf_config(args.layers, args.seq)
    vocab = config.vocab_size
    hf_model = build_hf(config, dtype)
    params = sum(p.numel() for p in hf_model.parameters())  # tied embedding counted once
    mg_model = build_megatron(config, hf_model, dtype, args.fused_swiglu)
    agreement = logits_agreement(hf_model, mg_model, vocab)
    log(f"params {params / 1e6:.1f}M; megatron vs HF logits max rel diff {agreement:.3g}")
    for layer in hf_model.model.layers:  # the FSDP2 path as FSDPTrainer builds it
        fully_shard(layer)
    fully_shard(hf_model)
    optimizers = {"megatron": torch.optim.AdamW(mg_model.parameters(), lr=1e-5),
                  "fsdp2_hf": torch.optim.AdamW(hf_model.parameters(), lr=1e-5)}
    runs = {"megatron": (megatron_step, mg_model), "fsdp2_hf": (hf_step, hf_model)}
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for batch in args.batch:
        for name, (step, model) in runs.items():
            result = measure(step, model, optimizers[name], batch, args.seq, vocab, args.steps, args.warmup, params)
            log(f"{name} batch {batch}: {result}")
            results[name].append(result)

    def best(name: str) -> dict | None:
        ok = [r for r in results[name] if not r.get("oom")]
        return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None

    same_batch = {}
    for mg, hf in zip(results["megatron"], results["fsdp2_hf"]):
        if not mg.get("oom") and not hf.get("oom"):
            same_batch[str(mg["batch"])] = mg["tokens_per_s"] / hf["tokens_per_s"]
    best_mg, best_hf = best("megatron"), best("fsdp2_hf")
    summary = {
        "bench": "megatron_mfu", "device": torch.cuda.get_device_name(), "params": params, "seq": args.seq,
        "layers": args.layers, "steps": args.steps, "dtype": "bfloat16", "peak_flops": PEAK_FLOPS,
        "fused_swiglu": args.fused_swiglu,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "megatron_core": megatron.core.__version__},
        "logits_max_rel_diff": agreement,
        "megatron": {"best": best_mg, "runs": results["megatron"]},
        "fsdp2_hf": {"best": best_hf, "runs": results["fsdp2_hf"]},
        "ratio_megatron_over_fsdp2_same_batch": same_batch,
        "ratio_megatron_over_fsdp2_best": (best_mg["tokens_per_s"] / best_hf["tokens_per_s"]
                                           if best_mg and best_hf else None),
    }
    shutdown_parallel(created)
    print(json.dumps(rounded(summary)), flush=True)
    return summary


if __name__ == "__main__":
    main()
