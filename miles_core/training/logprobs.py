"""Token log-probs and entropy from (vocab-parallel) logits, without full fp32 logits.

Shared by both trainers: the FSDP2 one passes whole-vocabulary logits and no group, the
Megatron one its tensor-parallel group with this rank's vocab slice. Logits arrive as
[N, V/tp] in the model dtype (any float dtype). A custom autograd function reduces each row
over the vocabulary in one pass: logits / T with padded-vocab columns at -inf, the row max m,
sum exp(x - m), the target logit and (for the entropy) sum exp(x - m) * x. With TP the per-rank
pieces are merged like an online softmax (all-reduce MAX of m, rescale, all-reduce SUM) into
per-token log-sum-exp, log p(target) and entropy. Only those per-token fp32 vectors are saved;
backward recomputes the softmax and writes the logits' gradient
``g_logp (onehot - p) / T - g_H p (x - E_p[x]) / T`` in the logits' dtype. This is the same
quantity as megatron's ``vocab_parallel_cross_entropy`` (-log p of the target), with the
entropy fused in.

On CUDA the per-row reduction and the gradient are torch.compile'd (Inductor fuses the upcast,
mask, exp and sums into one read of the logits, and the gradient into one read and one write
straight into the gradient's rows), so no fp32 copy of the logits exists. Rows go in chunks of
under 2^31 logits: Inductor indexes such kernels in int32, while one piece of a whole micro-batch
(32k tokens x 152k vocab is 5e9 logits) needs int64 indices and their slow divisions. Elsewhere
(or with ``MILES_COMPILE_LOGPROBS=0``) the same functions run eagerly over chunks of tokens, at
most ``CHUNK_ELEMENTS`` fp32 logits alive at a time.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 26  # fp32 logits per eager chunk: 256 MB
COMPILED_CHUNK_ELEMENTS = (1 << 31) - 1  # logits per compiled chunk: int32 indexing in Inductor's kernels


def _tp(group) -> tuple[int, int]:
    """(rank, size) of this process in the tensor-parallel group; (0, 1) without one."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _masked(logits: torch.Tensor, temperature: float, valid: int) -> torch.Tensor:
    """fp32 logits / T with columns >= valid (padded vocabulary) at -inf."""
    x = logits.float() / temperature
    cols = torch.arange(x.shape[-1], device=x.device)
    return torch.where(cols < valid, x, float("-inf"))


def _row_stats(logits, local, in_range, temperature: float, valid: int, with_entropy: bool):
    """Per row: max m (-inf when every column is padding), s = sum exp(x - m'), the target
    logit (0 off this rank) and sum exp(x - m') x (entropy only), with m' = m or 0 if m = -inf."""
    x = _masked(logits, temperature, valid)
    top = x.amax(dim=-1)
    shift = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    e = torch.exp(x - shift[:, None])
    total = e.sum(dim=-1)
    target = torch.where(in_range, x.gather(1, local[:, None]).squeeze(1), torch.zeros_like(top))
    ex = torch.where(e > 0, e * x, torch.zeros_like(x)).sum(dim=-1) if with_entropy else torch.zeros_like(top)
    return top, total, target, ex


def _row_grad(logits, lse, mean_x, local, in_range, g_logp, g_entropy, temperature: float, valid: int,
              with_entropy: bool):
    """d(sum g_logp logp + g_H H)/d logits of a block of rows, in the logits' dtype."""
    x = _masked(logits, temperature, valid)
    p = torch.exp(x - lse[:, None])
    cols = torch.arange(x.shape[-1], device=x.device)
    onehot = ((cols[None, :] == local[:, None]) & in_range[:, None]).to(p.dtype)
    out = g_logp[:, None] * (onehot - p)
    if with_entropy:
        centred = torch.where(p > 0, x - mean_x[:, None], torch.zeros_like(x))
        out = out - g_entropy[:, None] * p * centred
    return (out / temperature).to(logits.dtype)


def _row_grad_into(grad, *args):
    """_row_grad written into grad's rows (compiled: the kernel stores there, no copy)."""
    grad.copy_(_row_grad(*args))


_COMPILED: dict[str, object] = {}


def _use_compiled(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("MILES_COMPILE_LOGPROBS", "1") != "0" and "failed" not in _COMPILED


def _kernel(name: str, eager):
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(eager, dynamic=None)
    return _COMPILED[name]


def _run(name: str, eager, compiled: bool, *args):
    if compiled and "failed" not in _COMPILED:  # after one failure, the rest of the pass goes eager at once
        try:
            import torch._dynamo

            for a in args:  # rows vary between micro-batches (one dynamic compile); the vocab width does not
                if isinstance(a, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(a, 0)
                    if a.dim() == 2:
                        torch._dynamo.mark_static(a, 1)
            return _kernel(name, eager)(*args)
        except Exception as exc:  # noqa: BLE001 - GPU only; fall back to eager, never fail the step
            warnings.warn(f"compiled log-probs failed ({type(exc).__name__}: {exc}); using the eager path",
                          stacklevel=2)
            _COMPILED["failed"] = True
    return eager(*args)


def _default_chunk_rows(width: int, compiled: bool) -> int:
    """Rows per chunk: eager, ~CHUNK_ELEMENTS fp32 logits alive; compiled, under
    COMPILED_CHUNK_ELEMENTS logits, in multiples of 16 rows, so each chunk starts as aligned as
    the logits do (Inductor copies an input it finds misaligned)."""
    rows = max(1, (COMPILED_CHUNK_ELEMENTS if compiled else CHUNK_ELEMENTS) // width)
    return rows - rows % 16 if compiled and rows >= 16 else rows


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_size, with_entropy, chunk, group):
        rank, tp = _tp(group)
        n, width = logits.shape
        start = rank * width
        valid = vocab_size - start  # columns at or past it are padded vocabulary rows
        local = targets - start
        in_range = (local >= 0) & (local < width)
        local = torch.where(in_range, local, torch.zeros_like(local))
        compiled = _use_compiled(logits)
        chunk = chunk or _default_chunk_rows(width, compiled)
        pieces = [_run("stats", _row_stats, compiled, logits[s:s + chunk], local[s:s + chunk],
                       in_range[s:s + chunk], temperature, valid, with_entropy) for s in range(0, n, chunk)]
        top, total, target, ex = (torch.cat(p) if len(pieces) > 1 else p[0] for p in zip(*pieces))
        if tp > 1:
            best = top.clone()
            dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
            scale = torch.exp(top - best)  # 0 where this rank's slice is all padding
            stacked = torch.stack([total * scale, target, ex * scale])
            dist.all_reduce(stacked, group=group)
            top, (total, target, ex) = best, stacked
        lse = top + total.log()
        logp = target - lse
        mean_x = ex / total if with_entropy else torch.zeros_like(lse)
        ctx.save_for_backward(logits, local, in_range, lse, mean_x)
        ctx.temperature, ctx.valid, ctx.with_entropy, ctx.chunk, ctx.compiled = \
            temperature, valid, with_entropy, chunk, compiled
        entropy = lse - mean_x if with_entropy else torch.zeros_like(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local, in_range, lse, mean_x = ctx.saved_tensors
        n, chunk = logits.shape[0], ctx.chunk
        g_logp = grad_logp if grad_logp is not None else torch.zeros_like(lse)
        with_entropy = ctx.with_entropy and grad_entropy is not None
        g_entropy = grad_entropy if with_entropy else torch.zeros_like(lse)
        args = lambda s: (logits[s:s + chunk], lse[s:s + chunk], mean_x[s:s + chunk], local[s:s + chunk],  # noqa: E731
                          in_range[s:s + chunk], g_logp[s:s + chunk], g_entropy[s:s + chunk], ctx.temperature,
                          ctx.valid, with_entropy)
        if chunk >= n and not ctx.compiled:  # eager in one piece: its result is the gradient, no copy
            grad = _row_grad(*args(0))
        else:
            grad = torch.empty_like(logits)
            for s in range(0, n, chunk):
                _run("grad_into", _row_grad_into, ctx.compiled, grad[s:s + chunk], *args(s))
        return grad, None, None, None, None, None, None


def token_logprobs(local_logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int,
                   with_entropy: bool = False, chunk_tokens: int | None = None, tp_group=None):
    """log p(target) [B, T] (and entropy [B, T] or None) from vocab-parallel logits [B, T, V/tp].

    tp_group: the tensor-parallel group the vocabulary is split over (None: not split)."""
    b, t, width = local_logits.shape
    logp, entropy = _VocabParallelLogProb.apply(local_logits.reshape(b * t, width), targets.reshape(b * t),
                                                float(temperature), int(vocab_size), bool(with_entropy),
                                                chunk_tokens, tp_group)
    return logp.view(b, t), (entropy.view(b, t) if with_entropy else None)


def next_token_logprobs(local_logits: torch.Tensor, tokens: torch.Tensor, temperature: float, vocab_size: int,
                        with_entropy: bool = False, chunk_tokens: int | None = None, tp_group=None):
    """log p(tokens[:, t+1] | ..t) [B, T-1] (and entropy) from the logits of all T positions.

    Works on the whole [B, T, V/tp] logits (the last position gets a dummy target and is
    dropped): slicing off the last position first would copy the logits.
    """
    targets = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    logp, entropy = token_logprobs(local_logits, targets, temperature, vocab_size, with_entropy, chunk_tokens,
                                   tp_group)
    return logp[:, :-1], (entropy[:, :-1] if entropy is not None else None)
