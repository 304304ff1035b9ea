"""Training throughput and MFU: Megatron backend (local spec, SDPA core attention) vs the
FSDP2 / HF+SDPA path, same random Qwen3-0.6B-shaped model, same GPU, same run.

    python bench/megatron_mfu.py [--precision {as_run,pure_bf16,both}] [--batch 8 16 24] [--seq 2048]
                                 [--steps 10] [--warmup 3] [--layers 28] [--no-compile] [--static-shapes]
                                 [--sdpa {default,cudnn}] [--sweep] [--rope-per-layer] [--profile]
                                 [--foreach-adamw-row] [--out DIR] [--time-budget S]

On the lent GPU (Python 3.12, torch 2.11, no network; pydantic from tests/gpu/carry.py's `tools`
set, megatron-core carried as one 2.4 MB wheel):

    # here: python3 tests/gpu/carry.py .whl/gpu   (its `tools` set: pydantic, pytest), and
    #       pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    #           -d .whl/gpu/megatron megatron-core==0.19.2
    # there (carry .whl/gpu/tools and .whl/gpu/megatron):
    sh tests/gpu/install.sh .whl/gpu/tools && sh tests/gpu/install.sh .whl/gpu/megatron
    PYTHONPATH=/tmp/site python bench/megatron_mfu.py --layers 2 --seq 512 --batch 2 --steps 2 --warmup 1  # 45 s, H100
    PYTHONPATH=/tmp/site python bench/megatron_mfu.py --precision as_run --out /tmp/mfu     # the full shape, one
    PYTHONPATH=/tmp/site python bench/megatron_mfu.py --precision pure_bf16 --out /tmp/mfu  # precision per call
(the full shape with both precisions in one process may outrun a 10-minute device call; --time-budget
skips what would start late).

Precision (--precision, default both; each result row names its precision):
- as_run: each trainer as `miles run` configures it on a GPU. Both keep fp32 parameters (master
  weights), fp32 gradients and fp32 AdamW states and compute in bf16: FSDP2 through FSDPTrainer's own
  sharding (miles_core.training.fsdp._shard with training.fsdp.compute_dtype=bfloat16: FSDP2's
  MixedPrecisionPolicy gathers bf16 parameters, reduces in fp32), Megatron as MegatronTrainer runs it
  (an fp32 GPTModel, forward under torch.autocast(bf16)). TF32 stays at torch's default (off), as in
  the trainers. This is the headline: the top-level megatron / fsdp2_hf entries are its rows when it ran.
- pure_bf16: bf16 parameters, gradients and AdamW states on both sides, no autocast, TF32 on (what
  this bench measured before; neither trainer runs this way). Less memory and no fp32->bf16 casts, so
  its figures are upper bounds for the trainers.
The two run one after the other (the first one's models freed before the next is built).

One step = forward + token log-probs of every next token (the trainers' loss path: Megatron
through forward_logits + next_token_logprobs, HF through fsdp.causal_lm_logprobs, both the
fused vocab-parallel log-prob of miles_core/training/logprobs.py, torch.compile'd on
CUDA, over bf16 logits) + backward + grad clip + AdamW (fused, as the trainers run it on GPU).
Decoder layers are torch.compile'd on both
sides unless --no-compile (what training.compile_decoder_layers, off by default, turns on in the
trainers: pass --no-compile for the trainers' default). As in
the trainers, the first batch size compiles static graphs and the next one a batch-dynamic graph
that later sizes reuse; --static-shapes compiles one static graph per size instead (faster kernels
for Megatron, one compile per shape). The two backends alternate per batch size; a batch size that does not fit
is reported as {"oom": true}.

tokens/s counts batch * seq per step; MFU = 6 * params * tokens/s / 989e12 (H200 bf16 dense
peak; params counts the tied embedding once). Attention's own matmul FLOPs are not in 6*params:
they are reported apart as mfu_incl_attention, adding 6 * seq * heads * head_dim * layers per token
(QK^T and PV, causal half, forward + backward).

--sweep also measures the earlier configurations at the first batch size (eager layers;
eager chunked log-probs; HF's log_softmax over fp32 logits) and times causal GQA SDPA alone
per backend (flash, cuDNN, mem-efficient) and layout;
--profile writes a torch.profiler kernel table of one step per configuration to --out and
logs a breakdown by kernel kind. Progress goes to stderr; results go to --out/results.jsonl
as they come; the last stdout line is the JSON summary, with the GPU's name and the library
versions. Nothing is silenced: Python warnings and torch's logged warnings (a recompile limit hit,
a compiled kernel falling back to eager) are counted per precision in the JSON (`warnings`), as
are Dynamo's graphs and graph breaks and whether the compiled log-prob pass fell back to eager.
GPU only (on a CPU it exits with one line).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QWEN3_06B_SHAPE, gpu_identity, log, rounded, start_gpu_bench

PEAK_FLOPS = 989e12
PRECISIONS = {
    "as_run": {"params": "float32", "grads": "float32", "adamw_states": "float32", "compute": "bfloat16",
               "how": "fp32 master weights and AdamW states, bf16 compute: FSDP2 MixedPrecisionPolicy(param bf16, "
                      "reduce fp32) via FSDPTrainer's _shard (training.fsdp.compute_dtype=bfloat16); Megatron fp32 "
                      "GPTModel under torch.autocast(bf16) as MegatronTrainer; TF32 off (torch's default)"},
    "pure_bf16": {"params": "bfloat16", "grads": "bfloat16", "adamw_states": "bfloat16", "compute": "bfloat16",
                  "how": "bf16 parameters, gradients and AdamW states, no autocast, TF32 on; neither trainer runs "
                         "this way (an upper bound)"},
}


def hf_config(layers: int, seq: int):
    from transformers import Qwen3Config

    shape = {**QWEN3_06B_SHAPE, "num_hidden_layers": layers}
    return Qwen3Config(**shape, max_position_embeddings=max(seq, 4096), rope_theta=1e6, rms_norm_eps=1e-6,
                       architectures=["Qwen3ForCausalLM"])


def build_hf(config, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # older transformers
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    return model.cuda().train()


def shard_as_fsdp_trainer(hf_model, mixed_precision: bool) -> None:
    """FSDPTrainer's own sharding (fully_shard each decoder layer, then the model). mixed_precision:
    training.fsdp.compute_dtype=bfloat16, FSDP2 gathering bf16 copies of the fp32 parameters and
    reducing gradients in fp32; without it the parameters compute in their own dtype."""
    from miles_core.config.training import FSDPConfig
    from miles_core.training.fsdp import _shard

    _shard(hf_model, FSDPConfig(compute_dtype="bfloat16" if mixed_precision else "float32"))


def attention_flops_per_token(config, seq: int) -> float:
    """QK^T and PV matmul FLOPs per token (causal half, forward + backward), which 6 * params leaves out."""
    return 6 * seq * config.num_attention_heads * config.head_dim * config.num_hidden_layers


def build_megatron(config, hf_model, dtype, fused_swiglu: bool = False):
    """GPTModel with the HF model's weights (so both start from the same point)."""
    from miles_core.training.megatron import mapping
    from miles_core.training.megatron.model import build_gpt_model, model_shape

    model = build_gpt_model(config, 1, dtype=dtype, fused_swiglu=fused_swiglu, compile_layers=False).train()
    state = mapping.hf_to_megatron_rank({k: v.detach() for k, v in hf_model.state_dict().items()},
                                        model_shape(config, 1), 1, 0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return model


# ---- compile switches (reversible, so one process measures both) ----------------------------
def set_megatron_compiled(model, on: bool) -> None:
    from miles_core.training.megatron.model import compile_decoder_layers

    if on:
        compile_decoder_layers(model)
    else:
        for layer in model.decoder.layers:
            layer._compiled_call_impl = None


def set_hf_compiled(model, on: bool) -> None:
    from miles_core.training.fsdp import compile_decoder_layers

    if on:
        compile_decoder_layers(model)
    else:
        for layer in model.model.layers:
            layer.__dict__.pop("forward", None)


# ---- steps ------------------------------------------------------------------------------------
def megatron_step(model, optimizer, tokens, vocab_size: int, autocast: bool = False):
    """autocast: the forward under torch.autocast(bf16), as MegatronTrainer._token_logprobs runs it
    (the log-prob pass after it, on the bf16 logits)."""
    import torch

    from miles_core.training.logprobs import next_token_logprobs
    from miles_core.training.megatron.grad_norm import clip_grad_norm
    from miles_core.training.megatron.model import forward_logits

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = forward_logits(model, tokens)
    logp, _ = next_token_logprobs(logits, tokens, 1.0, vocab_size)
    loss = -logp.mean()
    loss.backward()
    clip_grad_norm(list(model.parameters()), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def hf_step(model, optimizer, tokens, vocab_size: int):
    from miles_core.training.fsdp import causal_lm_logprobs

    logp, _ = causal_lm_logprobs(model, tokens, None, 1.0)
    return _hf_update(model, optimizer, logp)


def hf_step_log_softmax(model, optimizer, tokens, vocab_size: int):
    """The FSDPTrainer loss path before the fused log-prob: log_softmax over fp32 logits."""
    import torch

    logits = model(input_ids=tokens).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return _hf_update(model, optimizer, logp)


def _hf_update(model, optimizer, logp):
    """Mean NLL backward, grad clip, AdamW step."""
    import torch

    loss = -logp.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def sdpa_context(kind: str):
    if kind == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True)


def measure(step, model, optimizer, batch: int, seq: int, vocab: int, steps: int, warmup: int,
            params: int, attn_flops_per_token: float, sdpa: str = "default") -> dict:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(batch)
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        with sdpa_context(sdpa):
            started = time.perf_counter()
            for _ in range(warmup):
                step(model, optimizer, tokens, vocab)
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - started
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                loss = step(model, optimizer, tokens, vocab)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return {"batch": batch, "oom": True}
    times.sort()
    step_s = times[len(times) // 2]  # median step
    tokens_per_s = batch * seq / step_s
    return {"batch": batch, "tokens_per_s": tokens_per_s, "mfu": 6 * params * tokens_per_s / PEAK_FLOPS,
            "mfu_incl_attention": (6 * params + attn_flops_per_token) * tokens_per_s / PEAK_FLOPS,
            "step_s": step_s, "step_s_min": times[0], "step_s_max": times[-1], "warmup_s": warm_s,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss)}


# ---- profile ----------------------------------------------------------------------------------
def _kind(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n or "cudnn" in n and "sdpa" in n:
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas", "splitk")):
        return "matmul"
    if "nccl" in n:
        return "nccl"
    if n.startswith("triton") or "triton_" in n:
        return "triton (compiled)"
    if "multi_tensor" in n or "foreach" in n or "adam" in n:
        return "optimizer"
    if "memcpy" in n or "memset" in n or "copy" in n or "fill" in n or "catarray" in n:
        return "copy/fill/cat"
    if "reduce" in n or "norm" in n or "softmax" in n:
        return "reduction"
    return "elementwise/other"


def profile_step(step, model, optimizer, batch: int, seq: int, vocab: int, name: str, out: Path | None,
                 sdpa: str = "default") -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
    with sdpa_context(sdpa):
        step(model, optimizer, tokens, vocab)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(model, optimizer, tokens, vocab)
            torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA and "#" not in evt.name \
                and not evt.name.startswith("ProfilerStep"):  # annotations (Optimizer.step#...) overlap kernels
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time_total / 1e3  # ms
    total = sum(kernels.values())
    kinds: dict[str, float] = {}
    for k, ms in kernels.items():
        kinds[_kind(k)] = kinds.get(_kind(k), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    if out is not None:
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=90)
        (out / f"profile_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.txt").write_text(table)  # a plain file name
    summary = {"name": name, "batch": batch, "gpu_kernel_ms": total,
               "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
               "top_kernels_ms": [[k[:110], ms] for k, ms in top[:12]]}
    log(f"profile {name} batch {batch}: kernels {total:.1f} ms; by kind " +
        ", ".join(f"{k} {v:.1f}" for k, v in summary["by_kind_ms"].items()))
    for k, ms in top[:12]:
        log(f"    {ms:8.2f} ms  {k[:110]}")
    return summary


def sdpa_probe(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> list[dict]:
    """fwd+bwd time of causal GQA SDPA per backend and layout (megatron's [s, b, h, d] permuted
    view vs HF's [b, h, s, d]); a backend that refuses the inputs is reported as such."""
    import torch
    from attention_kernels import fwd_bwd, sdpa, timed
    from torch.nn.attention import SDPBackend

    flops = 3 * 2 * batch * heads * seq * seq * head_dim  # fwd 2*b*h*s^2*d (causal half), bwd 2x
    rows = []
    for layout in ("megatron_view", "bhsd"):
        def make(h, layout=layout):
            if layout == "megatron_view":
                return torch.randn(seq, batch, h, head_dim, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
            return torch.randn(batch, h, seq, head_dim, device="cuda", dtype=torch.bfloat16)
        q, k, v = (make(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                ms = timed(fwd_bwd(sdpa([getattr(SDPBackend, backend)]), q, k, v, torch.ones_like(q)), 10)
                rows.append({"layout": layout, "backend": backend, "fwd_bwd_ms": ms, "tflops": flops / ms / 1e9})
            except Exception as exc:  # noqa: BLE001 - a refused backend is a result
                rows.append({"layout": layout, "backend": backend, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            log(f"sdpa {rows[-1]}")
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", choices=["as_run", "pure_bf16", "both"], default="both",
                        help="as_run: fp32 master weights and AdamW states, bf16 compute, as both trainers run; "
                             "pure_bf16: bf16 parameters and AdamW states (an upper bound); both: as_run then "
                             "pure_bf16 (default)")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 16, 24])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=QWEN3_06B_SHAPE["num_hidden_layers"])
    parser.add_argument("--fused-swiglu", action="store_true", help="megatron's torch.compile'd SwiGLU")
    parser.add_argument("--rope-per-layer", action="store_true",
                        help="megatron's own RoPE (cos and sin in every layer): the baseline of the trainers' "
                             "precomputed RoPE (miles_core/training/megatron/rope.py)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager decoder layers")
    parser.add_argument("--sdpa", choices=["default", "cudnn"], default="default",
                        help="cudnn: prefer the cuDNN SDPA backend (falls back to flash)")
    parser.add_argument("--sweep", action="store_true", help="also the earlier configurations, first batch size")
    parser.add_argument("--profile", action="store_true", help="profile one step per configuration")
    parser.add_argument("--out", type=Path, default=None, help="results.jsonl and profile tables here")
    parser.add_argument("--static-shapes", action="store_true",
                        help="compile one static graph per batch size (torch._dynamo automatic_dynamic_shapes off) "
                             "instead of one batch-dynamic graph after the first size")
    parser.add_argument("--foreach-adamw-row", action="store_true",
                        help="also both backends at the last batch size with AdamW's foreach implementation "
                             "(the trainers use fused=True on GPU)")
    parser.add_argument("--time-budget", type=float, default=0, help="seconds; skip what would start later")
    return parser.parse_args(argv)


COMPILE_SETTERS = {"megatron": set_megatron_compiled, "fsdp2_hf": set_hf_compiled}


class WarningCounter(logging.Handler):
    """Python warnings and torch's logged warnings while active, counted by source and message
    start (start_gpu_bench silences Python warnings for the other benches; here they are kept,
    since a fallback such as eager log-probs or a recompile limit changes the figure)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"log {record.name}: {record.getMessage()[:160]}"] += 1

    def __enter__(self) -> WarningCounter:
        import torch._dynamo  # noqa: F401 - torch's component loggers exist by now

        # a record climbs to the root or to the first logger that does not propagate (torch's
        # component loggers): attached to those, the counter sees each record once
        self.loggers = [logging.getLogger()] + [
            logger for name, logger in logging.Logger.manager.loggerDict.items()
            if isinstance(logger, logging.Logger) and name.split(".")[0] == "torch" and not logger.propagate]
        for logger in self.loggers:
            logger.addHandler(self)
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc) -> None:
        self.catcher.__exit__(*exc)
        for logger in self.loggers:
            logger.removeHandler(self)

    def take(self) -> dict[str, int]:
        """What was counted since the last take (and log it)."""
        for w in self.caught:
            self.counts[f"warning {w.category.__name__}: {str(w.message)[:160]}"] += 1
        self.caught.clear()
        counts, self.counts = dict(self.counts), Counter()
        for message, n in counts.items():
            log(f"{n} x {message}")
        return counts


class MfuBench:
    """Both backends' models and optimizers for one precision (see PRECISIONS), built once on one
    GPU, and the configurations run on them (each result logged, and appended to
    --out/results.jsonl as it comes)."""

    def __init__(self, args: argparse.Namespace, began: float, precision: str) -> None:
        import torch

        self.args, self.began, self.precision, self.profiles = args, began, precision, []
        as_run = precision == "as_run"
        # the trainers leave TF32 at torch's default (off); the pure bf16 rows keep this bench's old setting
        self.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = not as_run
        if args.static_shapes:
            import torch._dynamo

            torch._dynamo.config.automatic_dynamic_shapes = False
        self.config = hf_config(args.layers, args.seq)
        self.vocab = self.config.vocab_size
        param_dtype = torch.float32 if as_run else torch.bfloat16
        hf_model = build_hf(self.config, param_dtype)
        self.params = sum(p.numel() for p in hf_model.parameters())  # tied embedding counted once
        self.attn_flops = attention_flops_per_token(self.config, args.seq)
        if args.rope_per_layer:
            import miles_core.training.megatron.rope as rope

            rope.precompute_rope = lambda model: False
        mg_model = build_megatron(self.config, hf_model, param_dtype, args.fused_swiglu)
        self.agreement = logits_agreement(hf_model, mg_model, self.vocab, autocast=as_run)
        log(f"[{precision}] params {self.params / 1e6:.1f}M in {param_dtype}; megatron vs HF logits max rel diff "
            f"{self.agreement:.3g}; built in {time.perf_counter() - began:.0f} s")
        shard_as_fsdp_trainer(hf_model, mixed_precision=as_run)
        self.models = {"megatron": mg_model, "fsdp2_hf": hf_model}
        self.steps = {"megatron": functools.partial(megatron_step, autocast=as_run), "fsdp2_hf": hf_step}
        self.optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
                           for name, m in self.models.items()}
        self.dtypes = {name: sorted({str(p.dtype).removeprefix("torch.") for p in m.parameters()})
                       for name, m in self.models.items()}

    def close(self) -> None:
        """Free this precision's models, optimizers and compiled code before the next is built."""
        import torch
        import torch._dynamo

        self.models = self.optimizers = self.steps = None
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()

    def label(self, text: str) -> str:
        return f"[{self.precision}] {text}"

    def time_left(self) -> bool:
        return not self.args.time_budget or time.perf_counter() - self.began < self.args.time_budget

    def record(self, entry: dict) -> None:
        if self.args.out is not None:
            with open(self.args.out / "results.jsonl", "a") as fh:
                fh.write(json.dumps(rounded(entry)) + "\n")

    def configure(self, name: str, compiled: bool, compiled_logprobs: bool = True) -> None:
        COMPILE_SETTERS[name](self.models[name], compiled)
        os.environ["MILES_COMPILE_LOGPROBS"] = "1" if compiled_logprobs else "0"

    def run_one(self, label: str, name: str, step, batch: int, sdpa: str = "default", prof: bool = False) -> dict:
        a, model, optimizer = self.args, self.models[name], self.optimizers[name]
        result = measure(step, model, optimizer, batch, a.seq, self.vocab, a.steps, a.warmup, self.params,
                         self.attn_flops, sdpa)
        result = {"config": self.label(label), "precision": self.precision, "backend": name, **result}
        log(f"{result['config']}: {rounded(result, 3)}")
        self.record(result)
        if prof and not result.get("oom"):
            self.profiles.append(profile_step(step, model, optimizer, batch, a.seq, self.vocab, result["config"],
                                              a.out, sdpa))
            self.record({"profile": self.profiles[-1]})
        return result

    def earlier_configurations(self) -> list[dict]:
        """--sweep: eager layers with the log-prob paths that came before, at the first batch size."""
        rows, batch = [], self.args.batch[0]
        for label, name, step, compiled_lp in (
                ("megatron eager layers, eager chunked log-probs", "megatron", self.steps["megatron"], False),
                ("megatron eager layers, compiled log-probs", "megatron", self.steps["megatron"], True),
                ("fsdp2 eager layers, log_softmax fp32 logits", "fsdp2_hf", hf_step_log_softmax, True),
                ("fsdp2 eager layers, compiled log-probs", "fsdp2_hf", hf_step, True)):
            if self.time_left():
                self.configure(name, False, compiled_lp)
                rows.append(self.run_one(label, name, step, batch,
                                         prof=self.args.profile and "compiled log" not in label))
        return rows

    def batch_sizes(self) -> dict[str, list[dict]]:
        """Each batch size, the backends alternating, as the trainers run (compiled unless --no-compile)."""
        a = self.args
        results: dict[str, list[dict]] = {name: [] for name in self.models}
        for name in self.models:
            self.configure(name, a.compile, True)
        for i, batch in enumerate(a.batch):
            for name in self.models:
                if not self.time_left():
                    log(f"time budget spent: {self.label(name)} batch {batch} skipped")
                    continue
                label = f"{name} {'compiled' if a.compile else 'eager'} layers, sdpa {a.sdpa}"
                results[name].append(self.run_one(label, name, self.steps[name], batch, a.sdpa,
                                                  prof=a.profile and i == 0))
        return results

    def foreach_adamw(self, results: dict[str, list[dict]]) -> list[dict]:
        """--foreach-adamw-row: the last batch size that fit, with AdamW's foreach implementation."""
        import torch

        rows = []
        for name, model in self.models.items():
            ok = [r for r in results[name] if not r.get("oom")]
            if ok and self.time_left():
                self.optimizers[name] = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
                rows.append(self.run_one(f"{name} {'compiled' if self.args.compile else 'eager'} layers, AdamW "
                                         "foreach", name, self.steps[name], ok[-1]["batch"], self.args.sdpa))
        return rows


def dynamo_counts() -> dict:
    """Dynamo's graphs and graph breaks so far (reset with its counters between precisions)."""
    try:
        from torch._dynamo.utils import counters

        return {"graphs": int(counters["stats"]["unique_graphs"]),
                "graph_breaks": {k[:160]: v for k, v in counters["graph_break"].items()}}
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


def summarize_precision(bench: MfuBench, results: dict[str, list[dict]], sweep: list[dict],
                        warned: dict[str, int]) -> dict:
    from miles_core.training import logprobs

    def best(name: str) -> dict | None:
        ok = [r for r in results[name] if not r.get("oom")]
        return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None

    same_batch = {str(mg["batch"]): mg["tokens_per_s"] / hf["tokens_per_s"]
                  for mg, hf in zip(results["megatron"], results["fsdp2_hf"]) if not mg.get("oom") and not hf.get("oom")}
    best_mg, best_hf = best("megatron"), best("fsdp2_hf")
    return {
        "precision": bench.precision, **PRECISIONS[bench.precision], "param_dtypes_seen": bench.dtypes,
        "params": bench.params,
        "allow_tf32": bench.allow_tf32,
        "logits_max_rel_diff": bench.agreement,
        "megatron": {"best": best_mg, "runs": results["megatron"]},
        "fsdp2_hf": {"best": best_hf, "runs": results["fsdp2_hf"]},
        "ratio_megatron_over_fsdp2_same_batch": same_batch,
        "ratio_megatron_over_fsdp2_best": (best_mg["tokens_per_s"] / best_hf["tokens_per_s"]
                                           if best_mg and best_hf else None),
        "sweep": sweep, "profiles": bench.profiles,
        "dynamo": dynamo_counts(), "compiled_logprobs_fell_back_to_eager": "failed" in logprobs._COMPILED,
        "warnings": warned,
    }


def run_precision(args: argparse.Namespace, began: float, precision: str, warned: WarningCounter) -> dict:
    from torch._dynamo.utils import counters

    counters.clear()
    bench = MfuBench(args, began, precision)
    sweep = bench.earlier_configurations() if args.sweep else []
    results = bench.batch_sizes()
    if args.foreach_adamw_row:
        sweep += bench.foreach_adamw(results)
    summary = summarize_precision(bench, results, sweep, warned.take())
    bench.close()
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    began = start_gpu_bench(__file__, args.out)
    import megatron.core

    from miles_core.training.megatron.model import init_parallel, shutdown_parallel

    precisions = ["as_run", "pure_bf16"] if args.precision == "both" else [args.precision]
    with WarningCounter() as warned:
        created = init_parallel(1)  # nccl world of one: megatron's groups, and FSDP2's default group
        c = hf_config(args.layers, args.seq)
        probe = (sdpa_probe(args.batch[0], args.seq, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
                 if args.sweep else [])
        setup_warnings = warned.take()
        by_precision = {p: run_precision(args, began, p, warned) for p in precisions}
        shutdown_parallel(created)
    headline, identity = by_precision[precisions[0]], gpu_identity()
    summary = {
        "bench": "megatron_mfu", **identity, "megatron_core": megatron.core.__version__,
        "versions": {**{k: v for k, v in identity.items() if k != "gpu"}, "megatron_core": megatron.core.__version__},
        "params": headline["params"], "seq": args.seq, "layers": args.layers, "steps": args.steps,
        "peak_flops": PEAK_FLOPS, "attn_flops_per_token": attention_flops_per_token(c, args.seq),
        "compiled_layers": args.compile, "static_shapes": args.static_shapes, "sdpa": args.sdpa,
        "fused_swiglu": args.fused_swiglu, "rope_per_layer": args.rope_per_layer,
        "precisions_run": precisions, "headline_precision": precisions[0],
        # the headline precision's rows at the top level (as this bench's JSON always had them)
        **{k: headline[k] for k in ("logits_max_rel_diff", "megatron", "fsdp2_hf", "ratio_megatron_over_fsdp2_same_batch",
                                    "ratio_megatron_over_fsdp2_best")},
        "by_precision": by_precision, "sdpa_probe": probe, "setup_warnings": setup_warnings,
        "wall_s": time.perf_counter() - began,
    }
    rows = [r for p in by_precision.values() for r in p["sweep"] + p["megatron"]["runs"] + p["fsdp2_hf"]["runs"]]
    log("summary: " + " | ".join(
        f"{r['config']} b{r['batch']}: " + ("OOM" if r.get("oom") else
                                            f"{r['tokens_per_s']:.0f} tok/s MFU {100 * r['mfu']:.1f}% "
                                            f"(+attn {100 * r['mfu_incl_attention']:.1f}%)")
        for r in rows))
    print(json.dumps(rounded(summary)), flush=True)
    return summary


def logits_agreement(hf_model, mg_model, vocab: int, autocast: bool = False) -> float:
    """Max |HF - Megatron| logit over max |HF logit| on one random sequence; autocast: both
    forwards under torch.autocast(bf16), as the as-run trainers compute."""
    import torch

    from miles_core.training.megatron.model import forward_logits

    tokens = torch.randint(0, vocab, (1, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        a = hf_model(input_ids=tokens).logits.float()
        b = forward_logits(mg_model, tokens)[..., :vocab].float()
    return float((a - b).abs().max() / a.abs().max())


if __name__ == "__main__":
    main()
