"""Hugging Face <-> Megatron (local spec) state dicts, at any tensor-parallel size.

Full Megatron tensors ("TP=1 layout") are produced from HF tensors by :func:`hf_to_megatron`;
:func:`shard` cuts the TP-rank slice of one full tensor and :func:`unshard` glues the slices
back. Layout facts:

* ``linear_qkv`` rows are grouped per query group g: [q heads of g, k_g, v_g] (each
  ``head_dim`` rows per head); TP splits dim 0, i.e. whole groups per rank.
* ``linear_fc1`` = [gate; up]; TP rank r holds [gate_r; up_r] (each half split on its own).
* column-parallel (dim 0): qkv, fc1, word embeddings, output layer (vocab-parallel, padded to a
  multiple of ``make_vocab_size_divisible_by * tp``); row-parallel (dim 1): linear_proj, fc2;
  replicated: norms, q/k norms, MoE router.
* tied embeddings: HF has no ``lm_head.weight``; Megatron's output layer uses the embedding.
"""

from __future__ import annotations

import re

import torch

from miles_core.training.megatron.model import ModelShape

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# HF suffix inside a layer -> Megatron suffix (1:1 tensors).
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
          "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def _pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    if t.shape[0] == padded:
        return t
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    per = s.num_heads // s.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(s.num_kv_heads, per * s.head_dim, *rest)
    k = k.reshape(s.num_kv_heads, s.head_dim, *rest)
    v = v.reshape(s.num_kv_heads, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per = s.num_heads // s.num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(s.num_kv_heads, (per + 2) * s.head_dim, *rest)
    q, k, v = torch.split(grouped, [per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], s: ModelShape) -> dict[str, torch.Tensor]:
    """Full (TP=1 layout, vocab padded to ``s.padded_vocab``) Megatron tensors from HF ones."""
    out: dict[str, torch.Tensor] = {}
    attn: dict[int, dict[str, torch.Tensor]] = {}
    mlp: dict[tuple, dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if name == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = _pad_vocab(tensor, s.padded_vocab)
        elif name == "lm_head.weight":
            if not s.tied:
                out["output_layer.weight"] = _pad_vocab(tensor, s.padded_vocab)
        elif name == "model.norm.weight":
            out["decoder.final_layernorm.weight"] = tensor
        elif (m := _LAYER.match(name)) is not None:
            layer, rest = int(m.group(1)), m.group(2)
            prefix = f"decoder.layers.{layer}."
            if rest in _SIMPLE:
                out[prefix + _SIMPLE[rest]] = tensor
            elif rest.startswith("self_attn.") and rest.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                attn.setdefault(layer, {})[rest[len("self_attn."):]] = tensor
            elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                mlp.setdefault((prefix + "mlp.linear_fc1.weight",), {})[rest.split(".")[1]] = tensor
            elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # transformers 5 fused
                kind = "linear_fc1" if rest.endswith("gate_up_proj") else "linear_fc2"
                for expert in range(tensor.shape[0]):
                    out[f"{prefix}mlp.experts.local_experts.{expert}.{kind}.weight"] = tensor[expert]
            elif (e := _EXPERT.match(rest)) is not None:
                expert, proj = e.group(1), e.group(2)
                target = f"{prefix}mlp.experts.local_experts.{expert}."
                if proj == "down_proj":
                    out[target + "linear_fc2.weight"] = tensor
                else:
                    mlp.setdefault((target + "linear_fc1.weight",), {})[proj] = tensor
            else:
                raise KeyError(f"no Megatron mapping for HF tensor {name}")
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        else:
            raise KeyError(f"no Megatron mapping for HF tensor {name}")
    for layer, parts in attn.items():
        prefix = f"decoder.layers.{layer}.self_attention.linear_qkv."
        out[prefix + "weight"] = _interleave_qkv(parts["q_proj.weight"], parts["k_proj.weight"],
                                                 parts["v_proj.weight"], s)
        if "q_proj.bias" in parts:
            out[prefix + "bias"] = _interleave_qkv(parts["q_proj.bias"], parts["k_proj.bias"],
                                                   parts["v_proj.bias"], s)
    for (target,), parts in mlp.items():
        out[target] = torch.cat([parts["gate_proj"], parts["up_proj"]])
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], s: ModelShape) -> dict[str, torch.Tensor]:
    """HF tensors from full Megatron ones (vocab un-padded, qkv and fc1 split; no lm_head when tied).

    MoE experts come out per expert (`mlp.experts.{e}.gate_proj.weight`), the checkpoint layout
    that save_pretrained writes and SGLang loads (miles_core.weight_sync.transports.fused_layout gives the
    transformers 5 module layout).
    """
    inverse = {v: k for k, v in _SIMPLE.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mg.items():
        if name.endswith("_extra_state"):
            continue
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = tensor[: s.vocab_size]
        elif name == "output_layer.weight":
            if not s.tied:
                out["lm_head.weight"] = tensor[: s.vocab_size]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = tensor
        elif (m := _MG_LAYER.match(name)) is not None:
            prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
            if rest in inverse:
                out[prefix + inverse[rest]] = tensor
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(tensor, s)):
                    out[f"{prefix}self_attn.{proj}.{kind}"] = part
            elif rest == "mlp.linear_fc1.weight":
                gate, up = tensor.chunk(2)
                out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
            elif (e := re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$", rest)):
                target = f"{prefix}mlp.experts.{e.group(1)}."
                if e.group(2) == "linear_fc2":
                    out[target + "down_proj.weight"] = tensor
                else:
                    gate, up = tensor.chunk(2)
                    out[target + "gate_proj.weight"], out[target + "up_proj.weight"] = gate, up
            else:
                raise KeyError(f"no HF mapping for Megatron tensor {name}")
        else:
            raise KeyError(f"no HF mapping for Megatron tensor {name}")
    return {k: v.contiguous() for k, v in out.items()}


# ---- tensor parallel ----------------------------------------------------------------------------
def parallel_kind(name: str) -> str:
    """'column' (split dim 0), 'gated_column' (fc1: gate/up split separately), 'row' (dim 1)
    or 'replicated'."""
    if name.endswith("linear_fc1.weight"):
        return "gated_column"
    if name.endswith(COLUMN):
        return "column"
    if name.endswith(ROW):
        return "row"
    return "replicated"


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The TP-rank slice of one full Megatron tensor."""
    kind = parallel_kind(name)
    if tp == 1 or kind == "replicated":
        return full
    if kind == "gated_column":
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    dim = 0 if kind == "column" else 1
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over tp={tp}")
    return full.chunk(tp, dim=dim)[rank].contiguous()


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from its TP slices (rank order)."""
    kind = parallel_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "gated_column":
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=0 if kind == "column" else 1)


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def local_expert_index(name: str) -> int | None:
    """The local expert index in a Megatron expert tensor's name; None for other tensors."""
    return int(m.group(2)) if (m := _LOCAL_EXPERT.match(name)) else None


def renumber_expert(name: str, offset: int) -> str:
    """An expert tensor's name with its expert index shifted by offset (local <-> global)."""
    m = _LOCAL_EXPERT.match(name)
    return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}"


def hf_to_megatron_rank(hf: dict[str, torch.Tensor], s: ModelShape, tp: int, rank: int, ep: int = 1,
                        ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """This TP (and EP) rank's Megatron state dict (s must be the shape at this tp: padded vocab).

    With ep > 1 this rank keeps experts [ep_rank * E/ep, (ep_rank + 1) * E/ep), renumbered from 0.
    """
    out = {}
    for name, tensor in hf_to_megatron(hf, s).items():
        if ep > 1 and (index := local_expert_index(name)) is not None:
            per_rank = s.num_experts // ep
            if not ep_rank * per_rank <= index < (ep_rank + 1) * per_rank:
                continue
            name = renumber_expert(name, -ep_rank * per_rank)
        out[name] = shard(name, tensor, tp, rank).clone()
    return out


def megatron_ranks_to_hf(rank_dicts: list[dict[str, torch.Tensor]], s: ModelShape) -> dict[str, torch.Tensor]:
    """HF tensors from every TP rank's Megatron state dict (in rank order)."""
    names = [n for n in rank_dicts[0] if not n.endswith("_extra_state")]
    return megatron_to_hf({n: unshard(n, [d[n] for d in rank_dicts]) for n in names}, s)
