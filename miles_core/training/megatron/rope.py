"""RoPE's cos and sin computed once per forward instead of in every attention layer.

megatron-core hands each layer the rotation angles and computes ``cos(angles)`` and
``sin(angles)`` inside ``apply_rotary_pos_emb``, for queries and keys, in every layer; compiled,
the two are recomputed per element of q and k, forward and backward (a GPU profile of the
Qwen3-0.6B shape put megatron's RoPE kernels at ~3x the HF layer's). Here the model's rotary
embedding hands the layers ``cos || sin`` ([s, 1, 1, 2 * head_dim], float32) and attention applies
it with the same arithmetic, so the numbers are megatron's own. Plain RoPE only (no YaRN,
M-RoPE, MLA, fused or interleaved RoPE, partial rotary).
"""

from __future__ import annotations

import torch

_megatron_apply_rotary_pos_emb = None


def precompute_rope(model) -> bool:
    """Make ``model`` compute cos and sin once per forward (in place). Returns whether it did:
    models with another position embedding, or RoPE options this does not cover, keep megatron's."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary, config = getattr(model, "rotary_pos_emb", None), model.config
    if (type(rotary) is not RotaryEmbedding or config.rotary_interleaved or config.apply_rope_fusion
            or config.multi_latent_attention or getattr(rotary, "_miles_cos_sin", False)):
        return False
    if rotary.inv_freq.numel() * 2 != config.kv_channels:  # partial rotary: angles cover part of a head
        return False
    angles = rotary.forward

    def cos_sin(*args, **kwargs) -> torch.Tensor:
        emb = angles(*args, **kwargs)
        return torch.cat((torch.cos(emb), torch.sin(emb)), dim=-1)

    rotary.forward = cos_sin
    rotary._miles_cos_sin = True
    _route_attention_rope()
    return True


def _route_attention_rope() -> None:
    """Attention looks `apply_rotary_pos_emb` up in its module at each call: point it at
    apply_rope, which hands anything but cos || sin back to megatron's."""
    global _megatron_apply_rotary_pos_emb
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is not apply_rope:
        _megatron_apply_rotary_pos_emb = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = apply_rope


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None, mscale: float = 1.0,
               cp_group=None) -> torch.Tensor:
    """megatron's ``apply_rotary_pos_emb`` signature. ``freqs`` with twice t's last dimension is
    cos || sin from precompute_rope (angles never are: they cover at most a head); anything else
    goes to megatron's own function."""
    if freqs.shape[-1] != 2 * t.shape[-1]:
        return _megatron_apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale,
                                              cp_group=cp_group)
    if cu_seqlens is not None:
        raise NotImplementedError("precomputed RoPE does not cover packed (thd) sequences")
    cos, sin = freqs.chunk(2, dim=-1)
    # as megatron's _apply_rotary_pos_emb_bshd: scale in float32, then cast to t's dtype
    cos, sin = (cos * mscale).to(t.dtype), (sin * mscale).to(t.dtype)
    first, second = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-second, first), dim=-1) * sin
