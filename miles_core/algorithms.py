"""RL objectives as pure torch functions (see shared/rl-formulas.md).

Shapes: rewards [B]; token tensors [B, T] with a float loss mask m (1 on generated tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
MIS_LEVELS = ("token", "sequence", "geometric")
MIS_MODES = ("truncate", "clip", "mask")


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean_G r) / (std_G r + 1e-6); no std division when disabled, n=1 or std=0."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std = groups.std(dim=1, keepdim=True)
        centred = torch.where(std > 0, centred / (std + 1e-6), centred)
    return centred.reshape(-1)


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimators of x = logp - logp_ref: k1 = x, k2 = x^2/2, k3 = e^-x - 1 + x."""
    x = logp - logp_ref
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return (torch.exp(-x) - 1 + x).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int | None = None,
              num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """Reduce token values [B, T] to a scalar with a named aggregation mode.

    num_tokens / num_seqs override the denominators so that micro-batches of one batch sum
    to the batch's aggregate (gradient accumulation).
    """
    if mode == "token_mean":
        return (values * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
    per_seq_sum = (values * mask).sum(dim=1)
    seqs = num_seqs or values.shape[0]
    if mode == "seq_mean_token_mean":
        return (per_seq_sum / mask.sum(dim=1).clamp(min=1)).sum() / seqs
    if mode == "seq_mean_token_sum_norm":
        return (per_seq_sum / float(max_len or values.shape[1])).sum() / seqs
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {AGGREGATIONS}")


def _clipped_form(ratio, advantages, eps_low, eps_high, dual_clip_c):
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip_c is not None:
        if dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        bound = -dual_clip_c * advantages
        dual = (advantages < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
        is_clipped = is_clipped | dual
    return loss, is_clipped.to(ratio.dtype), ratio


def clipped_policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token PPO loss max(-rho A, -clip(rho) A); returns (loss [B,T], clipped [B,T], ratio).

    rho = exp(clamp(logp - logp_old, -20, 20)). Dual clip (c > 1): where A < 0,
    L = min(L, -c A). `clipped` marks tokens whose gradient is cut by either clip.
    """
    ratio = torch.exp((logp - logp_old).clamp(-20, 20))
    return _clipped_form(ratio, advantages, eps_low, eps_high, dual_clip_c)


def gspo_sequence_ratio(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO rho_i = exp(s_i), s_i = sum_t m (logp - logp_old) / sum_t m, broadcast to [B, T]."""
    s = ((logp - logp_old) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return torch.exp(s.clamp(-20, 20)).unsqueeze(1).expand_as(logp)


def gspo_policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO: the clipped PPO form with the sequence ratio rho_i (geometric mean of token ratios).

    Returns (loss [B,T], clipped [B,T], ratio [B,T]); gradient flows through every token of s_i.
    """
    ratio = gspo_sequence_ratio(logp, logp_old, mask)
    return _clipped_form(ratio, advantages, eps_low, eps_high, dual_clip_c)


def cispo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: L_t = -stopgrad(clip(rho, 1 - eps_low, 1 + eps_high)) A logp_t.

    Returns (loss [B,T], clipped [B,T] = rho outside the range, ratio) like the PPO losses.
    """
    ratio = torch.exp((logp - logp_old).clamp(-20, 20))
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).to(ratio.dtype)
    return -weight * advantages * logp, clipped, ratio


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", max_len: int | None = None,
             num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """SFT: agg(-logp) over the response tokens (m)."""
    return aggregate(-logp, mask, mode, max_len, num_tokens, num_seqs)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None) -> torch.Tensor:
    """Clipped value loss, masked token mean of max((clip(V, V_old-c, V_old+c) - R)^2, (V - R)^2).

    No 0.5 factor (as in shared/rl-formulas.md); clip=None gives the plain squared error.
    """
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = torch.minimum(torch.maximum(values, old_values - clip), old_values + clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
