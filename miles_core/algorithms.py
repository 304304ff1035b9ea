"""RL objectives as pure torch functions; each docstring states the formula it computes.

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


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, group=None) -> torch.Tensor:
    """Whitening (A - mean) / sqrt(var + eps) with masked mean and (population) variance.

    With torch.distributed initialized and a process group given, sum / count / sum of squares
    are all-reduced over it, so every data-parallel rank uses the global statistics. Positions
    outside the mask come back as 0.
    """
    # float64 stats: var = E[x^2] - mean^2 cancels badly in float32 when |mean| >> std.
    v, m = _zero_out(values, mask).double(), mask.double()
    stats = torch.stack([(v * m).sum(), m.sum(), (v * v * m).sum()])
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    count = stats[1].clamp(min=1)
    mean = stats[0] / count
    var = (stats[2] / count - mean * mean).clamp(min=0)
    return ((v - mean) * torch.rsqrt(var + eps) * m).to(values.dtype)


def _zero_out(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where, not x * mask: padded positions may hold inf/nan log-probs and inf * 0 = nan.
    return torch.where(mask > 0, x, torch.zeros_like(x))


def _last_token_onehot(mask: torch.Tensor) -> torch.Tensor:
    """One-hot [B, T] of the last masked-in token per row (all-zero row if the mask is empty)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1, keepdim=True).values
    return ((positions == last) & (last >= 0)).to(mask.dtype)


def _token_rewards(rewards, mask, kl, beta):
    """rew_t = -beta m_t KL_t, plus r_i on the last masked-in token (shared by REINFORCE++ and GAE)."""
    rew = rewards.to(mask.dtype).unsqueeze(1) * _last_token_onehot(mask)
    if kl is not None and beta:
        rew = rew - beta * _zero_out(kl, mask)
    return rew


def _masked_discounted_sum(x: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """y_t = x_t + discount * y_next over masked-in positions only; masked tokens carry no decay."""
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        running = torch.where(mask[:, t] > 0, x[:, t] + discount * running, running)
        out[:, t] = running
    return out * mask


def reinforce_pp_returns(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                         beta: float = 0.0, gamma: float = 1.0, group=None) -> torch.Tensor:
    """REINFORCE++: G_t = sum_{k>=t} gamma^(k-t) rew_k, A = masked_whiten(G).

    rew_t = -beta m_t KL_t, plus r_i on the last masked-in token. k - t counts masked-in
    tokens only (same convention as GAE), so tool/observation holes do not decay the return.
    """
    returns = _masked_discounted_sum(_token_rewards(rewards, mask, kl, beta), mask, gamma)
    return masked_whiten(returns, mask, group=group)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_size: int, mask: torch.Tensor,
                                     kl: torch.Tensor | None = None, beta: float = 0.0,
                                     group=None) -> torch.Tensor:
    """REINFORCE++-baseline: r~ = r - mean_G r; A_t = r~ - beta KL_t; A = masked_whiten(A)."""
    centred = grpo_advantages(rewards, group_size, normalize_std=False)
    adv = centred.to(mask.dtype).unsqueeze(1) * mask
    if kl is not None and beta:
        adv = adv - beta * _zero_out(kl, mask)
    return masked_whiten(adv, mask, group=group)


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   kl: torch.Tensor | None = None, beta: float = 0.0, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO GAE: delta_t = rew_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, R = A + V.

    rew_t = -beta KL_t, + r_i on the last trainable token; V after the end = 0. The recursion
    runs over masked-in tokens only ("next" = next trainable token). Not whitened (call
    masked_whiten); both outputs are 0 outside the mask.
    """
    rew = _token_rewards(rewards, mask, kl, beta)
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        on = mask[:, t] > 0
        a = rew[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        next_adv = torch.where(on, a, next_adv)
        next_value = torch.where(on, values[:, t], next_value)
        adv[:, t] = torch.where(on, a, torch.zeros_like(a))
    return adv, (adv + values) * mask


def opd_adjust_advantages(advantages: torch.Tensor, logp_student_old: torch.Tensor,
                          logp_teacher: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """On-policy distillation: A_t <- A_t - coef (logp_student_old_t - logp_teacher_t), masked."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return _zero_out(advantages - coef * (logp_student_old - logp_teacher), mask)


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: bool [B / group_size], True for groups whose rewards are not all equal."""
    groups = rewards.view(-1, group_size)
    return groups.max(dim=1).values != groups.min(dim=1).values


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
    return loss, is_clipped.float(), ratio


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

    No 0.5 factor; clip=None gives the plain squared error.
    """
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = values.clamp(old_values - clip, old_values + clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def _log_ratio(logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Detached: mismatch weights rescale the loss, they are not optimised.
    return _zero_out(logp_a - logp_b, mask).detach()


def tis_weights(logp_old_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                low: float = 0.0, high: float = 2.0) -> torch.Tensor:
    """TIS: w_t = clamp(exp(logp_old_train - logp_rollout), low, high); 0 outside the mask."""
    ratio = torch.exp(_log_ratio(logp_old_train, logp_rollout, mask).clamp(-20, 20))
    return ratio.clamp(low, high) * mask


def icepop_weights(logp_old_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                   low: float = 0.5, high: float = 5.0) -> torch.Tensor:
    """IcePop: w_t = ratio if low <= ratio <= high else 0, ratio = exp(logp_old_train - logp_rollout)."""
    ratio = torch.exp(_log_ratio(logp_old_train, logp_rollout, mask).clamp(-20, 20))
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio)) * mask


def mis_weights(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                level: str = "token", mode: str = "truncate", low: float = 0.0, high: float = 2.0,
                veto_threshold: float | None = None) -> torch.Tensor:
    """MIS / rejection sampling weights [B, T] for the rollout-vs-train mismatch.

    level: token exp(d_t); sequence exp(sum_t m d_t); geometric exp(sum_t m d_t / sum_t m),
    with d = logp_train - logp_rollout (log clamped to [-20, 20]). mode: truncate min(w, high);
    clip clamp(w, low, high); mask w if low <= w <= high else 0. veto_threshold zeroes every
    token of a sequence that has any masked-in token ratio below it.
    """
    d = _log_ratio(logp_train, logp_rollout, mask)
    if level == "token":
        log_w = d
    elif level == "sequence":
        log_w = d.sum(dim=1, keepdim=True).expand_as(d)
    elif level == "geometric":
        log_w = (d.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(d)
    else:
        raise ValueError(f"unknown MIS level {level!r}; use one of {MIS_LEVELS}")
    w = torch.exp(log_w.clamp(-20, 20))
    if mode == "truncate":
        w = w.clamp(max=high)
    elif mode == "clip":
        w = w.clamp(low, high)
    elif mode == "mask":
        w = torch.where((w >= low) & (w <= high), w, torch.zeros_like(w))
    else:
        raise ValueError(f"unknown MIS mode {mode!r}; use one of {MIS_MODES}")
    if veto_threshold is not None:
        vetoed = ((torch.exp(d.clamp(-20, 20)) < veto_threshold) & (mask > 0)).any(dim=1, keepdim=True)
        w = w * (~vetoed).to(w.dtype)
    return w * mask


def mismatch_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Train/rollout mismatch, masked token means (detached 0-d tensors):

    mismatch/abs_ratio_minus_one = |exp(logp_train - logp_rollout) - 1|; mismatch/kl = k3 of
    x = logp_train - logp_rollout (KL(train || rollout)); mismatch/logprob_abs_diff = |x|.
    """
    x = _log_ratio(logp_train, logp_rollout, mask)
    count = mask.sum().clamp(min=1)

    def mean(v):
        return (v * mask).sum() / count

    return {
        "mismatch/abs_ratio_minus_one": mean((torch.exp(x.clamp(-20, 20)) - 1).abs()),
        "mismatch/kl": mean(kl_estimate(x, torch.zeros_like(x), "k3")),
        "mismatch/logprob_abs_diff": mean(x.abs()),
    }
