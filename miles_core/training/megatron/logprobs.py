"""Token log-probs and entropy from vocab-parallel logits, without full fp32 logits.

Logits arrive as this TP rank's vocab slice in the model dtype. They are processed in chunks
of tokens: each chunk is upcast to fp32, divided by the temperature, its padded-vocab columns
masked, and fed to megatron's fused ``vocab_parallel_cross_entropy`` (-log p of the target).
With gradients, each chunk runs under activation checkpointing, so at most one chunk of
fp32 logits (``chunk_tokens x vocab/tp``) is alive at a time in forward and in backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 26  # fp32 logits per chunk: 256 MB
_NEG = -1e30  # finite "minus infinity": 0 * _NEG stays 0 in the entropy sum


def _tp():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def _chunk(local_logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int,
           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region, vocab_parallel_cross_entropy

    rank, _, group = _tp()
    width = local_logits.shape[-1]
    x = local_logits.float() / temperature
    start = rank * width
    if start + width > vocab_size:  # padded vocabulary rows (zero weights) must not count
        columns = torch.arange(start, start + width, device=x.device)
        x = x.masked_fill(columns >= vocab_size, _NEG)
    entropy = torch.zeros((), device=x.device)
    if with_entropy:
        top = x.detach().max(dim=-1, keepdim=True).values
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = x - top
        e = shifted.exp()
        sums = reduce_from_tensor_model_parallel_region(torch.stack([e.sum(-1), (e * shifted).sum(-1)], dim=-1))
        entropy = sums[..., 0].log() - sums[..., 1] / sums[..., 0]
    neg_logp = vocab_parallel_cross_entropy(x.clone() if with_entropy else x, targets)
    return -neg_logp, entropy


def token_logprobs(local_logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int,
                   with_entropy: bool = False, chunk_tokens: int | None = None):
    """log p(target) [B, T] (and entropy [B, T] or None) from vocab-parallel logits [B, T, V/tp]."""
    b, t, width = local_logits.shape
    flat, flat_targets = local_logits.reshape(b * t, width), targets.reshape(b * t)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // width)
    grad = torch.is_grad_enabled() and local_logits.requires_grad
    logps, entropies = [], []
    for start in range(0, b * t, chunk):
        piece, piece_targets = flat[start:start + chunk], flat_targets[start:start + chunk]
        if grad and b * t > chunk:
            logp, ent = checkpoint(_chunk, piece, piece_targets, temperature, vocab_size, with_entropy,
                                   use_reentrant=False)
        else:
            logp, ent = _chunk(piece, piece_targets, temperature, vocab_size, with_entropy)
        logps.append(logp)
        entropies.append(ent)
    logp = torch.cat(logps).view(b, t)
    return logp, (torch.cat(entropies).view(b, t) if with_entropy else None)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Global L2 grad norm over TP (sharded tensors counted once per shard, replicated ones once)
    and clip to max_norm. Gradients must already be summed over data parallel ranks."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.detach().float().pow(2).sum()
    torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(scale.to(p.grad.dtype))
    return norm
