"""Per-GPU memory estimate of the trainer, printed by `miles plan` before anything is started.

What it counts (both trainers keep fp32 parameters, fp32 gradients and fp32 AdamW moments,
and run matmuls under bf16 autocast on GPU; FSDP2 shards optimizer states with the parameters,
Megatron keeps them whole on every data-parallel rank):

* weights 4 B, gradients 4 B, optimizer 8 B (Adam m and v) per parameter this GPU holds;
  a critic counts as a second trainable model, a reference / teacher as frozen fp32 weights
  (the teacher is assumed to have the policy's shape);
* parameters this GPU holds: attention, dense MLP and the (padded) vocabulary / tp; experts
  / (ep * tp) (megatron's expert tensor parallel size defaults to tp); norms and the router
  replicated; FSDP2: everything / training.data_parallel_size;
* activations of one micro-batch of b sequences of s = data.max_prompt_tokens +
  rollout.max_new_tokens tokens, at 2 B per element on GPU (bf16) and 4 B on CPU. Per token
  and layer the backward keeps: 4h (the two norm inputs and the two matmul inputs), the q, k,
  v projections and the attention output ((a + 2 kv) d + a d) / tp, and the MLP's fc1 output
  and activation 3F / tp (MoE: k routed copies of h + 3 F_moe, / tp). With full recomputation
  only each layer's input h is kept, plus one layer's full set while it is recomputed. The
  logits of the micro-batch (V_pad / tp per token) are kept once and their gradient once.

The rollout engines' weights (`engine_weight_bytes`) are counted apart, in the HF layout of one
engine before tensor parallelism: 2 B per parameter in bf16; with rollout.precision=fp8 each
decoder layer's linear projections take 1 B per element plus a float32 scale per 128x128 block
(miles_core/weight_sync/quantization.py), the rest (embeddings, norms, router, lm_head) stays 2 B.

With training.lora: the base is frozen (weights 4 B per parameter, no gradients, no optimizer
states) and the adapters train (4 + 4 + 8 B per adapter parameter, r (in + out) per adapted
dense linear layer, sharded by FSDP2 like the rest); the adapters' own activations (r per token
and layer) are not counted.

Not counted: CUDA context and allocator fragmentation (a few GiB), FSDP2's gathered copy of
the layer being computed, the eager path's fp32
logits chunk (256 MB), communication buffers, and the rollout engines (SGLang sizes its own
KV cache from mem_fraction_static); the rollout engines' weights and KV cache are estimated
separately, per phase, where they share the trainer's GPUs (phase_peaks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from miles_core.config import ModelConfig, RunConfig

GIB = 1024 ** 3
PARAM_BYTES = 4  # fp32 master weights (both trainers)
GRAD_BYTES = 4  # fp32 gradients
ADAM_BYTES = 8  # fp32 exp_avg + exp_avg_sq
MEGATRON_VOCAB_MULTIPLE = 128  # megatron pads the vocabulary to a multiple of 128 * tp

# Shapes of the production recipes' models, from their public config.json, so that `miles plan`
# needs no download; a config.json in the local Hugging Face cache wins over these.
KNOWN_HF_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen3-4B": dict(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen3-30B-A3B": dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936,
                               tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                               moe_intermediate_size=768),
}


@dataclass(frozen=True)
class ModelDims:
    """The shape numbers the estimate needs (Qwen3 / Qwen2 / Llama / Qwen3-MoE decoders)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    qk_norm: bool = True

    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelDims:
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        return cls(num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
                   num_kv_heads=hf.get("num_key_value_heads", heads), head_dim=hf.get("head_dim") or hidden // heads,
                   intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                   tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
                   num_experts=hf.get("num_experts", 0) or 0, experts_per_token=hf.get("num_experts_per_tok", 0) or 0,
                   moe_intermediate_size=hf.get("moe_intermediate_size", 0) or 0,
                   qk_norm=hf.get("model_type", "qwen3").startswith("qwen3"))


@dataclass(frozen=True)
class Layout:
    """How one model replica is split over GPUs."""

    tp: int = 1
    ep: int = 1
    recompute: bool = False
    vocab_multiple: int = 1
    """The vocabulary is padded to a multiple of vocab_multiple * tp (megatron: 128; HF: 1)."""
    fsdp: int = 1
    """FSDP2 ranks the parameters, gradients and optimizer states are sharded over."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per trainer GPU, by kind."""

    params_total: int
    params_per_gpu: int
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    frozen_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.frozen_bytes + self.activation_bytes


def padded_vocab(vocab_size: int, layout: Layout) -> int:
    multiple = layout.vocab_multiple * layout.tp
    return -(-vocab_size // multiple) * multiple


def parameter_counts(d: ModelDims, layout: Layout) -> tuple[int, int]:
    """(parameters of the model, parameters one GPU holds under the layout)."""
    tp, ep = layout.tp, layout.ep
    attn = d.hidden_size * (d.num_heads + 2 * d.num_kv_heads) * d.head_dim + d.num_heads * d.head_dim * d.hidden_size
    norms = 2 * d.hidden_size + (2 * d.head_dim if d.qk_norm else 0)
    router = d.hidden_size * d.num_experts  # every layer is sparse in an MoE model (Qwen3-MoE)
    experts = d.num_experts * 3 * d.hidden_size * d.moe_intermediate_size
    dense_mlp = 0 if d.num_experts else 3 * d.hidden_size * d.intermediate_size
    vocab_matrices = 1 if d.tied_embeddings else 2
    total = (d.num_layers * (attn + norms + router + experts + dense_mlp)
             + vocab_matrices * d.vocab_size * d.hidden_size + d.hidden_size)
    per_gpu = (d.num_layers * ((attn + dense_mlp) // tp + norms + router + experts // (ep * tp))
               + vocab_matrices * padded_vocab(d.vocab_size, layout) * d.hidden_size // tp + d.hidden_size)
    return total, -(-per_gpu // layout.fsdp)


def layer_activation_elements(d: ModelDims, tp: int) -> int:
    """Elements per token one layer keeps for backward (see the module docstring)."""
    attn = 4 * d.hidden_size + ((d.num_heads + 2 * d.num_kv_heads) * d.head_dim + d.num_heads * d.head_dim) // tp
    if d.num_experts:
        return attn + d.experts_per_token * (d.hidden_size + 3 * d.moe_intermediate_size) // tp
    return attn + 3 * d.intermediate_size // tp


def activation_bytes(d: ModelDims, layout: Layout, micro_batch: int, seq_tokens: int, element_bytes: int) -> int:
    tokens = micro_batch * seq_tokens
    one_layer = layer_activation_elements(d, layout.tp)
    kept = d.num_layers * d.hidden_size + one_layer if layout.recompute else d.num_layers * one_layer
    logits = 2 * padded_vocab(d.vocab_size, layout) // layout.tp  # the logits and their gradient
    return tokens * (kept + logits) * element_bytes


def estimate(d: ModelDims, layout: Layout, micro_batch: int, seq_tokens: int, element_bytes: int = 2,
             trainable_models: int = 1, frozen_models: int = 0) -> MemoryEstimate:
    """Per-GPU bytes of `trainable_models` trained copies (policy, critic) and `frozen_models`
    frozen ones (reference, teacher) of this shape, plus one micro-batch's activations each."""
    total, per_gpu = parameter_counts(d, layout)
    return MemoryEstimate(
        params_total=total, params_per_gpu=per_gpu,
        weights_bytes=trainable_models * per_gpu * PARAM_BYTES, grads_bytes=trainable_models * per_gpu * GRAD_BYTES,
        optimizer_bytes=trainable_models * per_gpu * ADAM_BYTES, frozen_bytes=frozen_models * per_gpu * PARAM_BYTES,
        activation_bytes=trainable_models * activation_bytes(d, layout, micro_batch, seq_tokens, element_bytes))


# ---- from a recipe ----------------------------------------------------------------------------------
def _cached_hf_config(repo: str, revision: str | None) -> dict | None:
    """config.json of an hf:// source if it is in the local Hugging Face cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    path = try_to_load_from_cache(repo, "config.json", revision=revision or None)
    return json.loads(Path(path).read_text()) if isinstance(path, str) else None


def model_dims(model: ModelConfig) -> ModelDims | None:
    """The model's shape without downloading weights; None when it cannot be known offline."""
    src = model.source
    if src.startswith("builtin:"):
        from miles_core.tiny import CHARACTERS, SPECIAL_TOKENS

        t = model.tiny
        return ModelDims(num_layers=t.num_layers, hidden_size=t.hidden_size, num_heads=t.num_attention_heads,
                         num_kv_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
                         intermediate_size=t.intermediate_size, vocab_size=len(SPECIAL_TOKENS + CHARACTERS),
                         tied_embeddings=True)
    if src.startswith("hf://"):
        repo, _, revision = src[len("hf://"):].partition("@")
        hf = _cached_hf_config(repo, revision) or KNOWN_HF_CONFIGS.get(repo)
        return ModelDims.from_hf_config(hf) if hf else None
    local = Path(src).expanduser() / "config.json"
    if "://" not in src and local.is_file():
        return ModelDims.from_hf_config(json.loads(local.read_text()))
    return None


def lora_parameter_count(d: ModelDims, modules: list[str], rank: int) -> int:
    """Adapter parameters of the whole model: r (in + out) per adapted linear layer. MoE experts
    are fused tensors, not linear layers, so only a dense model's MLP projections count."""
    q_out, kv_out = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    mlp = 0 if d.num_experts else d.intermediate_size
    shapes = {"q_proj": (d.hidden_size, q_out), "k_proj": (d.hidden_size, kv_out), "v_proj": (d.hidden_size, kv_out),
              "o_proj": (q_out, d.hidden_size), "gate_proj": (d.hidden_size, mlp), "up_proj": (d.hidden_size, mlp),
              "down_proj": (mlp, d.hidden_size)}
    per_layer = sum(rank * sum(shapes[m]) for m in modules if m in shapes and all(shapes[m]))
    return d.num_layers * per_layer


def with_lora(est: MemoryEstimate, adapter_params: int, fsdp: int) -> MemoryEstimate:
    """The policy's weights become frozen and its adapters the trainable parameters (no critic:
    a LoRA run trains one model)."""
    adapters = -(-adapter_params // fsdp)
    return replace(est, weights_bytes=adapters * PARAM_BYTES, grads_bytes=adapters * GRAD_BYTES,
                   optimizer_bytes=adapters * ADAM_BYTES, frozen_bytes=est.frozen_bytes + est.weights_bytes)


def trainer_layout(cfg: RunConfig) -> Layout:
    t = cfg.training
    if t.backend == "megatron":
        return Layout(tp=t.megatron.tensor_parallel_size, ep=t.megatron.expert_parallel_size,
                      recompute=t.megatron.recompute_activations, vocab_multiple=MEGATRON_VOCAB_MULTIPLE)
    return Layout(fsdp=t.dp, recompute=t.fsdp.activation_checkpointing)


def estimate_for_config(cfg: RunConfig) -> MemoryEstimate | None:
    """The trainer's per-GPU estimate for a recipe; None when the model's shape is unknown offline."""
    from miles_core import objectives

    dims = model_dims(cfg.model)
    if dims is None:
        return None
    a = cfg.algorithm
    frozen = int(objectives.needs_reference(a)) + int(a.effective_opd_coef > 0)
    seq_tokens = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    element_bytes = 2 if cfg.training.gpus_per_trainer > 0 else 4
    layout = trainer_layout(cfg)
    est = estimate(dims, layout, cfg.training.micro_batch_size, seq_tokens, element_bytes,
                   trainable_models=1 + int(a.uses_critic), frozen_models=frozen)
    if cfg.training.lora_enabled:
        lora = cfg.training.lora
        est = with_lora(est, lora_parameter_count(dims, lora.modules, lora.rank), layout.fsdp)
    return est


def projection_shapes(d: ModelDims) -> list[tuple[int, int]]:
    """[out, in] of every decoder-layer linear projection (attention q, k, v, o; dense MLP or each
    expert's gate, up, down): the matrices rollout.precision=fp8 quantizes."""
    q_out, kv_out = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    h = d.hidden_size
    attn = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out)]
    if d.num_experts:
        mlp = d.num_experts * [(d.moe_intermediate_size, h), (d.moe_intermediate_size, h), (h, d.moe_intermediate_size)]
    else:
        mlp = [(d.intermediate_size, h), (d.intermediate_size, h), (h, d.intermediate_size)]
    return d.num_layers * (attn + mlp)


def engine_weight_bytes(d: ModelDims, precision: str) -> int:
    """Bytes of one engine's weights (whole model, before tp) at rollout.precision."""
    from miles_core.weight_sync.quantization import weight_bytes

    total, _ = parameter_counts(d, Layout())
    if precision == "bf16":
        return 2 * total
    shapes = projection_shapes(d)
    quantized = sum(r * c for r, c in shapes)
    return weight_bytes(quantized, total - quantized, shapes)


def precision_rows(cfg: RunConfig) -> list[tuple[str, str]]:
    """What each side computes in, and what FP8 saves in each engine's weights, for `miles plan`."""
    t = cfg.training
    if t.fp8:
        trainer = "fp8 matmuls (torchao float8 linears), fp32 master weights"
    elif t.gpus_per_trainer <= 0:
        trainer = "float32 (CPU)"
    else:
        trainer = f"{t.fsdp.compute_dtype if t.backend == 'fsdp2' else 'bf16 autocast'}, fp32 master weights"
    rows = [("precision", f"rollout {cfg.rollout.precision}; training {trainer}")]
    dims = model_dims(cfg.model)
    if dims is not None:
        bf16, mine = engine_weight_bytes(dims, "bf16"), engine_weight_bytes(dims, cfg.rollout.precision)
        saved = f", {_size(bf16 - mine)} less than bf16" if mine < bf16 else ""
        rows.append(("engine weights", f"{_size(mine)} per engine ({cfg.rollout.precision}{saved}; before tp)"))
    return rows


def _size(n_bytes: int) -> str:
    return f"{n_bytes / GIB:.2f} GiB" if n_bytes >= GIB else f"{n_bytes / 2 ** 20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"


def describe_estimate(cfg: RunConfig) -> list[tuple[str, str]]:
    """(what, size) rows for `miles plan`."""
    est = estimate_for_config(cfg)
    if est is None:
        return [("estimate", f"unknown: the shape of {cfg.model.source} is not available offline "
                             "(put its config.json in the Hugging Face cache or use a local directory)")]
    seq_tokens = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    layout = trainer_layout(cfg)
    return [
        ("parameters", f"{_count(est.params_total)} in the model, {_count(est.params_per_gpu)} on each GPU"),
        ("weights (fp32)" if not cfg.training.lora_enabled else "LoRA adapters (fp32)", _size(est.weights_bytes)),
        ("gradients (fp32)", _size(est.grads_bytes)),
        ("optimizer (AdamW m, v fp32)", _size(est.optimizer_bytes)),
        ("frozen copies (reference/teacher" + (", LoRA base)" if cfg.training.lora_enabled else ")"),
         _size(est.frozen_bytes)),
        ("activations", f"{_size(est.activation_bytes)} (micro-batch {cfg.training.micro_batch_size} x {seq_tokens} "
                        f"tokens at most, recompute {'on' if layout.recompute else 'off'})"),
        ("total per trainer GPU", f"{_size(est.total_bytes)} (+ CUDA context and fragmentation)"),
    ]


# ---- phases of a shared GPU (placement.time_sharing) -----------------------------------------------
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DEFAULT_GPU_GIB = 80.0  # an H100's; `miles plan --gpu-gib` for others


@dataclass(frozen=True)
class PhasePeaks:
    """Bytes on one GPU the trainer shares with engines, in each phase of a step."""

    rollout: int
    train: int
    sync: int

    @property
    def peak(self) -> int:
        return max(self.rollout, self.train, self.sync)


def engine_bytes(cfg: RunConfig, d: ModelDims) -> tuple[int, int]:
    """(weights, KV cache) of the engines on one GPU. The KV cache counted is what a sync step's
    batch needs at once (every sample decoding to the full length, max_running_requests at a
    time), not what SGLang reserves: mem_fraction_static claims a share of whatever is free."""
    r = cfg.rollout
    tp = int(r.engine.server_args.get("tp_size") or max(1, int(r.gpus_per_engine))) if r.engine.kind == "sglang" else 1
    per_gpu = 1 if r.gpus_per_engine >= 1 else min(r.num_engines, max(1, int(1 / r.gpus_per_engine)))
    element = DTYPE_BYTES.get(cfg.model.dtype, 2)
    weights = per_gpu * parameter_counts(d, Layout())[0] * element // tp
    sequences = -(-r.num_prompts_per_step * r.num_samples_per_prompt // r.num_engines)
    limit = (getattr(r.engine, "max_running_requests", None)
             or getattr(r.engine, "server_args", {}).get("max_running_requests"))
    sequences = min(sequences, int(limit)) if limit else sequences
    per_token = 2 * d.num_layers * d.num_kv_heads * d.head_dim * element  # keys and values
    return weights, per_gpu * sequences * (cfg.data.max_prompt_tokens + r.max_new_tokens) * per_token // tp


def phase_peaks(cfg: RunConfig) -> PhasePeaks | None:
    """Per-GPU bytes while engines generate (rollout), the trainer updates (train) and weights
    move (sync), for a trainer and engines on the same GPUs; None when the shape is unknown.
    Time-shared, each phase holds only its side: rollout the engines, train the trainer, sync the
    trainer's state (no activations, gradients freed) with the engines' weights and, for the
    shared_memory transport, its engine-dtype copy of the weights. Unshared, every phase holds all."""
    d, trainer = model_dims(cfg.model), estimate_for_config(cfg)
    if d is None or trainer is None:
        return None
    weights, kv = engine_bytes(cfg, d)
    resident = trainer.weights_bytes + trainer.optimizer_bytes + trainer.frozen_bytes
    buffer = weights if cfg.rollout.weight_transport.kind == "shared_memory" else 0
    if cfg.placement.time_sharing:
        return PhasePeaks(rollout=weights + kv, train=trainer.total_bytes, sync=resident + weights + buffer)
    return PhasePeaks(rollout=resident + weights + kv + buffer, train=trainer.total_bytes + weights + kv + buffer,
                      sync=resident + trainer.grads_bytes + weights + kv + buffer)


def shares_a_gpu(cfg: RunConfig) -> bool:
    return cfg.placement.layout == "colocated" and cfg.training.gpus_per_trainer > 0 and cfg.rollout.gpus_per_engine > 0


def check_phases_fit(cfg: RunConfig, gpu_gib: float = DEFAULT_GPU_GIB) -> None:
    """Refuses a time-shared layout whose busiest phase exceeds one GPU (the point of sharing is
    to fit; a layout that does not would fail with out-of-memory after the model loads)."""
    peaks = phase_peaks(cfg) if cfg.placement.time_sharing and shares_a_gpu(cfg) else None
    if peaks is None or peaks.peak <= gpu_gib * GIB:
        return
    phase = max(("rollout", "train", "sync"), key=lambda name: getattr(peaks, name))
    raise ValueError(f"the {phase} phase needs {_size(peaks.peak)} per GPU, more than the GPU's {gpu_gib:g} GiB: "
                     "lower rollout.num_prompts_per_step or rollout.max_new_tokens (KV cache), "
                     "training.micro_batch_size or turn on training.fsdp.activation_checkpointing (activations), "
                     "or spread the trainer over more GPUs (training.gpus_per_trainer)")


def describe_phases(cfg: RunConfig) -> list[tuple[str, str]]:
    """(phase, per-GPU peak) rows for `miles plan` where trainer and engines share GPUs."""
    peaks = phase_peaks(cfg) if shares_a_gpu(cfg) else None
    if peaks is None:
        return []
    how = "time-shared" if cfg.placement.time_sharing else "not time-shared: all phases hold everything"
    return [(f"rollout ({how})", _size(peaks.rollout)), ("train", _size(peaks.train)), ("sync", _size(peaks.sync)),
            ("peak per GPU", f"{_size(peaks.peak)} (+ CUDA context and fragmentation)")]
