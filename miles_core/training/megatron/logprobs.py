"""Token log-probs and entropy from vocab-parallel logits, without full fp32 logits.

Logits arrive as this TP rank's vocab slice [N, V/tp] in the model dtype. A custom autograd
function walks them in chunks of tokens: each chunk is upcast to fp32, divided by the
temperature, its padded-vocab columns masked, and reduced over the vocabulary (max, sum of
exp, target logit, sum p*x: all-reduced over TP) to per-token log-sum-exp, log p(target) and,
optionally, entropy. Only those per-token fp32 vectors are saved; backward recomputes the
softmax of one chunk at a time and writes the logits' gradient
``g_logp (onehot - p) / T - g_H p (x - E_p[x]) / T`` in the logits' dtype. At most one chunk
of fp32 logits (``CHUNK_ELEMENTS``) is alive at a time, in forward and in backward. This is
the same quantity as megatron's ``vocab_parallel_cross_entropy`` (-log p of the target), with
the entropy fused in and fewer passes over the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 26  # fp32 logits per chunk: 256 MB


def _tp():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def _scaled(chunk: torch.Tensor, temperature: float, start: int, vocab_size: int) -> torch.Tensor:
    """fp32 logits / T of one chunk with padded vocabulary columns at -inf (a fresh tensor)."""
    x = chunk.float()
    if temperature != 1.0 or x.data_ptr() == chunk.data_ptr():
        x = x / temperature
    width = x.shape[-1]
    if start + width > vocab_size:  # padded vocabulary rows (zero weights) must not count
        x[:, max(0, vocab_size - start):] = float("-inf")
    return x


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_size, with_entropy, chunk):
        rank, tp, group = _tp()
        n, width = logits.shape
        start = rank * width
        local = targets - start
        in_range = (local >= 0) & (local < width)
        local = torch.where(in_range, local, torch.zeros_like(local))
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        logp = torch.empty_like(lse)
        mean_x = torch.zeros_like(lse)
        for s in range(0, n, chunk):
            rows = slice(s, min(s + chunk, n))
            x = _scaled(logits[rows], temperature, start, vocab_size)
            top = x.max(dim=-1).values
            if tp > 1:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            e = torch.exp(x - top[:, None])
            target = torch.where(in_range[rows], x.gather(1, local[rows, None]).squeeze(1), 0.0)
            parts = [e.sum(-1), target]
            if with_entropy:  # sum_v e_v * x_v (masked columns: e = 0, and 0 * -inf must not be nan)
                parts.append(torch.where(e > 0, e * x, torch.zeros_like(x)).sum(-1))
            stacked = torch.stack(parts)
            if tp > 1:
                dist.all_reduce(stacked, group=group)
            lse[rows] = top + stacked[0].log()
            logp[rows] = stacked[1] - lse[rows]
            if with_entropy:
                mean_x[rows] = stacked[2] / stacked[0]
        ctx.save_for_backward(logits, local, in_range, lse, mean_x)
        ctx.temperature, ctx.vocab_size, ctx.with_entropy, ctx.chunk, ctx.start = \
            temperature, vocab_size, with_entropy, chunk, start
        entropy = lse - mean_x if with_entropy else torch.zeros_like(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local, in_range, lse, mean_x = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n = logits.shape[0]
        t = ctx.temperature
        for s in range(0, n, ctx.chunk):
            rows = slice(s, min(s + ctx.chunk, n))
            x = _scaled(logits[rows], t, ctx.start, ctx.vocab_size)
            p = torch.exp(x - lse[rows, None])
            g = grad_logp[rows, None] if grad_logp is not None else torch.zeros_like(lse[rows, None])
            out = -g * p
            out.scatter_add_(1, local[rows, None], (g * in_range[rows, None]).to(out.dtype))
            if ctx.with_entropy and grad_entropy is not None:
                centred = torch.where(p > 0, x - mean_x[rows, None], torch.zeros_like(x))
                out -= grad_entropy[rows, None] * p * centred
            grad[rows] = (out / t).to(grad.dtype)
        return grad, None, None, None, None, None


def token_logprobs(local_logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int,
                   with_entropy: bool = False, chunk_tokens: int | None = None):
    """log p(target) [B, T] (and entropy [B, T] or None) from vocab-parallel logits [B, T, V/tp]."""
    b, t, width = local_logits.shape
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // width)
    logp, entropy = _VocabParallelLogProb.apply(local_logits.reshape(b * t, width), targets.reshape(b * t),
                                                float(temperature), int(vocab_size), bool(with_entropy), chunk)
    return logp.view(b, t), (entropy.view(b, t) if with_entropy else None)


def next_token_logprobs(local_logits: torch.Tensor, tokens: torch.Tensor, temperature: float, vocab_size: int,
                        with_entropy: bool = False, chunk_tokens: int | None = None):
    """log p(tokens[:, t+1] | ..t) [B, T-1] (and entropy) from the logits of all T positions.

    Works on the whole [B, T, V/tp] logits (the last position gets a dummy target and is
    dropped): slicing off the last position first would copy the logits.
    """
    targets = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    logp, entropy = token_logprobs(local_logits, targets, temperature, vocab_size, with_entropy, chunk_tokens)
    return logp[:, :-1], (entropy[:, :-1] if entropy is not None else None)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Global L2 grad norm over TP (sharded tensors counted once per shard, replicated ones once)
    and clip to max_norm. Gradients must already be summed over data parallel ranks."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    own = [p.grad.detach() for p in params if param_is_not_tensor_parallel_duplicate(p)]
    norms = torch._foreach_norm(own) if own else []
    total = torch.stack([n.float() for n in norms]).pow(2).sum() if own else \
        torch.zeros((), device=params[0].grad.device)
    dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([p.grad.detach() for p in params], scale)
    return norm
