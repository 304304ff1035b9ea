"""RL objectives as pure torch functions (see shared/rl-formulas.md).

Shapes: rewards [B]; token tensors [B, T] with a float loss mask m (1 on generated tokens).
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


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


def clipped_policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token PPO loss max(-rho A, -clip(rho) A); returns (loss [B,T], clipped [B,T], ratio)."""
    log_ratio = (logp - logp_old).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float(), ratio


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
