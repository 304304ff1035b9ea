"""A megatron-core GPTModel built from a Hugging Face config (local spec, SDPA attention).

Supported: Qwen3 dense (q/k RMSNorm, no qkv bias), Qwen2 (qkv bias, no q/k norm), Llama
(no bias), Qwen3-MoE (router + SequentialMLP experts, every layer sparse). The layer spec is
megatron's local (non-TransformerEngine) one with its core attention swapped for
:class:`SDPAttention` (torch scaled_dot_product_attention, causal).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles_core.net import free_port

# Architecture (HF `architectures[0]`) -> family. The family decides biases and q/k norms.
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MODEL_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "qwen3_moe": "qwen3_moe"}
DEFAULT_VOCAB_DIVISOR = 128


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_ARCHITECTURES))


def family_of(hf_config) -> str:
    """The architecture family of an HF config, or ValueError naming the supported ones."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(f"the Megatron backend does not support architecture {archs or model_type!r}; "
                     f"supported architectures: {supported_list()}")


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _rope(hf_config) -> tuple[float, dict]:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), {}
    if rope_type == "llama3":
        # megatron-core hard-codes low/high frequency factors 1/4 and an 8192 original context.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if all(float(params.get(k, v)) == v for k, v in fixed.items()):
            return float(theta), {"rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise NotImplementedError(f"rope type {rope_type!r} with {params} is not supported by the Megatron backend")


@dataclass
class ModelShape:
    """What mapping needs to know about a model (derived from the HF config)."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int | None = None
    tp: int = 1


def model_shape(hf_config, tp: int = 1, vocab_divisor: int = DEFAULT_VOCAB_DIVISOR) -> ModelShape:
    family = family_of(hf_config)
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp or kv % tp:
        raise ValueError(f"tensor parallel size {tp} must divide attention heads ({heads}) and kv heads ({kv})")
    if family == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        raise NotImplementedError("Llama with attention_bias/mlp_bias is not supported by the Megatron backend")
    if family == "qwen3_moe" and (getattr(hf_config, "mlp_only_layers", None) or
                                  getattr(hf_config, "decoder_sparse_step", 1) != 1):
        raise NotImplementedError("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step != 1) "
                                  "is not supported by the Megatron backend")
    return ModelShape(
        family=family, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_heads=heads, num_kv_heads=kv,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        vocab_size=hf_config.vocab_size, padded_vocab=padded_vocab_size(hf_config.vocab_size, tp, vocab_divisor),
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        num_experts=getattr(hf_config, "num_experts", None) if family == "qwen3_moe" else None, tp=tp)


# ---- core attention --------------------------------------------------------------------------
try:  # megatron-core >= 0.12
    from megatron.core.transformer.module import MegatronModule as _Base
except ImportError:  # pragma: no cover
    _Base = torch.nn.Module


_HAS_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class SDPAttention(_Base):
    """Core attention with megatron's DotProductAttention signature, computed by
    torch.nn.functional.scaled_dot_product_attention with a causal mask.

    query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]. Padding is
    on the right, so the causal mask alone is exact for every real token.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) != 1:
            raise NotImplementedError("SDPAttention does not implement context parallelism")
        self.config = config
        self.layer_number = layer_number
        kv_channels = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention supports neither packed sequences nor attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = {}
        if k.shape[1] != q.shape[1]:  # query heads g*r..(g+1)*r-1 share kv head g
            if _HAS_ENABLE_GQA:
                gqa = {"enable_gqa": True}
            else:  # pragma: no cover - torch < 2.5
                repeat = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             dropout_p=self.dropout if self.training else 0.0, **gqa)
        sq, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}


# ---- process groups --------------------------------------------------------------------------
def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 0) -> bool:
    """Join (or create) the default process group and megatron's model-parallel groups.

    Uses gloo on CPU and nccl on GPU; returns True when this call created the default group.
    """
    from megatron.core import parallel_state, tensor_parallel

    from miles_core.training.megatron.cpu_compat import enable_cpu_mode

    enable_cpu_mode()
    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        created = True
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() != tp:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        if dist.get_world_size() % (tp * pp * ep):
            raise ValueError(f"world size {dist.get_world_size()} is not a multiple of tp*pp*ep={tp * pp * ep}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return created


def shutdown_parallel(destroy_default_group: bool) -> None:
    """Undo init_parallel: megatron's groups, and the default group when we created it."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_default_group and dist.is_initialized():
        dist.destroy_process_group()


# ---- the model ---------------------------------------------------------------------------------
def transformer_config(hf_config, tp: int = 1, dtype: torch.dtype = torch.float32, ep: int = 1,
                       recompute: bool = False, fused_swiglu: bool = False, routing_replay: bool = False):
    from megatron.core.transformer import TransformerConfig

    shape = model_shape(hf_config, tp)
    on_cpu = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim,
        ffn_hidden_size=hf_config.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm,
        # fused_swiglu: megatron's torch.compile'd SwiGLU (GPU only; opt-in, not measured yet)
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=fused_swiglu and not on_cpu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype, use_cpu_initialization=on_cpu, perform_initialization=False,
        attention_softmax_in_fp32=True,
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if shape.family == "qwen3_moe":
        kwargs.update(
            num_moe_experts=hf_config.num_experts, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_topk=hf_config.num_experts_per_tok, moe_router_score_function="softmax",
            # top-k on logits then softmax over the k == softmax, top-k, renormalise (norm_topk_prob)
            moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", True),
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall" if (ep > 1 and not on_cpu) else "allgather",
            moe_grouped_gemm=False, moe_router_dtype="fp32",
            # routers take replayed experts when told (routing_replay.py); free routing otherwise
            moe_enable_routing_replay=routing_replay)
    elif routing_replay:
        raise ValueError(f"routing replay needs an MoE model; this {shape.family} model has no experts")
    return TransformerConfig(**kwargs)


def layer_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_gpt_model(hf_config, tp: int = 1, dtype: torch.dtype = torch.float32, ep: int = 1,
                    vocab_divisor: int = DEFAULT_VOCAB_DIVISOR, recompute: bool = False, post_process: bool = True,
                    fused_swiglu: bool = False, compile_layers: bool = False, routing_replay: bool = False):
    """A GPTModel for this rank (model-parallel groups must be initialised: see init_parallel).

    post_process=False gives the trunk only (no final norm, no output layer; returns hidden
    states [s, b, h]), used for the critic. compile_layers: torch.compile each decoder layer
    (GPU only; training.compile_decoder_layers). routing_replay: MoE
    routers that can replay given experts (``model.router_replays``, see routing_replay.py)."""
    from megatron.core.models.gpt import GPTModel

    from miles_core.training.megatron.cpu_compat import enable_cpu_mode
    from miles_core.training.megatron.rope import precompute_rope

    enable_cpu_mode()
    shape = model_shape(hf_config, tp, vocab_divisor)
    config = transformer_config(hf_config, tp, dtype, ep, recompute, fused_swiglu, routing_replay)
    theta, scaling = _rope(hf_config)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(config), vocab_size=shape.padded_vocab,
                     max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
                     post_process=post_process, share_embeddings_and_output_weights=shape.tied and post_process,
                     position_embedding_type="rope",
                     rotary_base=theta, rotary_percent=1.0, parallel_output=True, **scaling)
    _mark_tensor_parallel(model)
    _pass_row_parallel_group(model)
    _batch_major_output(model)
    precompute_rope(model)
    if routing_replay:
        from miles_core.training.megatron.routing_replay import claim_router_replays

        claim_router_replays(model)
    if torch.cuda.is_available():
        model = model.cuda()
        if compile_layers and not recompute:
            compile_decoder_layers(model)
    return model


def compile_decoder_layers(model) -> int:
    """torch.compile each TransformerLayer (in place; parameter names unchanged). Dynamo breaks
    the graph at megatron's linear layers (their process-group look-ups), so what is compiled
    is the elementwise work between the matmuls (norms, RoPE, SwiGLU, residual adds) plus SDPA;
    the layers share the compiled code. Returns the number of layers compiled."""
    import torch._dynamo

    layers = list(model.decoder.layers)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(layers) + 8)
    for layer in layers:
        layer.compile()
    return len(layers)


def _pass_row_parallel_group(model) -> None:
    """RowParallelLinear.forward calls its matmul with ``tp_group=None``, which makes megatron look
    the group up and issue a DeprecationWarning on every call (a graph break under torch.compile).
    Pass the layer's own group instead: the row-parallel matmul never uses it (no input-gradient
    all-reduce, no sequence parallelism), so nothing else changes."""
    from megatron.core.tensor_parallel import RowParallelLinear

    for module in model.modules():
        if isinstance(module, RowParallelLinear) and not hasattr(module, "_miles_forward_impl"):
            module._miles_forward_impl = module._forward_impl

            def forward_impl(*args, _module=module, **kwargs):
                if kwargs.get("tp_group", 0) is None:
                    kwargs["tp_group"] = _module.tp_group
                return _module._miles_forward_impl(*args, **kwargs)

            module._forward_impl = forward_impl


def _batch_major_output(model) -> None:
    """GPTModel computes logits [s, b, V] and returns ``logits.transpose(0, 1).contiguous()``: a
    copy of the largest activation in forward and of its gradient in backward. Running the output
    layer on the [b, s, h] view of the hidden states instead gives [b, s, V] logits whose [s, b, V]
    view makes that ``.contiguous()`` free. Same numbers (each logit is one row times the weight)."""
    layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if layer is None or getattr(layer, "sequence_parallel", False) or getattr(layer, "_miles_batch_major", False):
        return
    forward = layer.forward

    def batch_major(input_, *args, **kwargs):
        out, bias = forward(input_.transpose(0, 1), *args, **kwargs)
        return out.transpose(0, 1), bias

    layer.forward = batch_major
    layer._miles_batch_major = True


def _mark_tensor_parallel(model) -> None:
    """With perform_initialization=False megatron never tags TP-split weights
    (`tensor_model_parallel`, set inside its init functions), so grad-norm code would count
    them as replicated. Tag them here: column/vocab-parallel on dim 0, row-parallel on dim 1."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for module in model.modules():
        dim = 0 if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) else \
            1 if isinstance(module, RowParallelLinear) else None
        weight = getattr(module, "weight", None)
        tagged = getattr(weight, "tensor_model_parallel", False)
        if dim is not None and isinstance(weight, torch.nn.Parameter) and not tagged:
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def causal_positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's vocab slice of the logits, [b, s, padded_vocab / tp] (right padding, causal)."""
    return model(input_ids=tokens, position_ids=causal_positions(tokens), attention_mask=None)
