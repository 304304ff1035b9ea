"""From an AlgorithmConfig to advantages, importance weights and the policy loss.

The one place where algorithm names branch; the trainer backends only call these. Batch
tensors are [B, T] in next-token layout with a float mask of trainable tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles_core import algorithms as algo
from miles_core.config import AlgorithmConfig
from miles_core.metrics import TRAIN_LOSS

Batch = dict[str, torch.Tensor]


def needs_reference(cfg: AlgorithmConfig) -> bool:
    return cfg.kl_loss_coef > 0 or cfg.kl_in_reward_coef > 0


def old_logp_from_update_forward(cfg: AlgorithmConfig, num_updates: int) -> bool:
    """With one update per batch the old policy *is* the current one, so its log-probs equal
    the (detached) log-probs of the update's own forward pass: skip a separate scoring pass,
    unless advantages or weights need them before the update."""
    return (num_updates == 1 and cfg.name in ("grpo", "gspo", "cispo") and cfg.effective_opd_coef == 0
            and cfg.correction.kind == "none" and cfg.old_logprob_source == "trainer" and not cfg.uses_critic)


def anchor_old_logprobs(cfg: AlgorithmConfig, b: Batch) -> None:
    """Choose what the PPO ratio is taken against (b["old_logp"]); both backends call this.

    trainer: the trainer's recomputed log-probs, and a correction (tis/icepop/mis) may weight
    each token by exp(trainer - rollout). rollout: the behaviour policy's log-probs, so the
    ratio pi_theta / pi_rollout itself corrects the mismatch (and validation rejects a
    correction on top, which would count it twice). The recomputed log-probs stay in
    b["trainer_logp"] for the mismatch metrics either way.
    """
    b["trainer_logp"] = b["old_logp"]
    if cfg.old_logprob_source == "rollout":
        b["old_logp"] = b["rollout_logp"] * b["mask"]


def _reward_kl(cfg: AlgorithmConfig, b: Batch) -> torch.Tensor | None:
    if cfg.kl_in_reward_coef == 0:
        return None
    return algo.kl_estimate(b["old_logp"], b["ref_logp"], cfg.kl_estimator) * b["mask"]


def _group(cfg: AlgorithmConfig, b: Batch, group_size: int) -> torch.Tensor:
    rewards = b["rewards"]
    if cfg.group_normalize:
        rewards = algo.grpo_advantages(rewards, group_size, cfg.normalize_std)
    return rewards[:, None] * b["mask"]


def _reinforce_pp(cfg: AlgorithmConfig, b: Batch, group_size: int) -> torch.Tensor:
    return algo.reinforce_pp_returns(b["rewards"], b["mask"], _reward_kl(cfg, b), cfg.kl_in_reward_coef, cfg.gamma)


def _reinforce_pp_baseline(cfg: AlgorithmConfig, b: Batch, group_size: int) -> torch.Tensor:
    return algo.reinforce_pp_baseline_advantages(b["rewards"], group_size, b["mask"], _reward_kl(cfg, b),
                                                 cfg.kl_in_reward_coef)


def _gae(cfg: AlgorithmConfig, b: Batch, group_size: int) -> torch.Tensor:
    advantages, b["returns"] = algo.gae_advantages(b["rewards"], b["old_values"], b["mask"], _reward_kl(cfg, b),
                                                   cfg.kl_in_reward_coef, cfg.gamma, cfg.lam)
    return algo.masked_whiten(advantages, b["mask"])


def _no_reward(cfg: AlgorithmConfig, b: Batch, group_size: int) -> torch.Tensor:
    return torch.zeros_like(b["mask"])


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AlgorithmConfig, Batch, int], torch.Tensor]] = {
    "grpo": _group, "gspo": _group, "cispo": _group, "ppo": _gae,
    "reinforce_pp": _reinforce_pp, "reinforce_pp_baseline": _reinforce_pp_baseline, "opd": _no_reward,
}


def compute_advantages(cfg: AlgorithmConfig, b: Batch, group_size: int) -> None:
    """Fill b["advantages"] (and b["returns"] for PPO) for the whole batch at once, so that
    group statistics and whitening see every sample."""
    advantages = ADVANTAGE_ESTIMATORS[cfg.name](cfg, b, group_size)
    if cfg.effective_opd_coef > 0:
        advantages = algo.opd_adjust_advantages(advantages, b["old_logp"], b["teacher_logp"], b["mask"],
                                                cfg.effective_opd_coef)
    b["advantages"] = advantages.to(b["mask"].dtype)


def importance_weights(cfg: AlgorithmConfig, b: Batch) -> torch.Tensor | None:
    """Rollout-mismatch weights w [B, T] (None when no correction is configured)."""
    c = cfg.correction
    if c.kind == "tis":
        return algo.tis_weights(b["old_logp"], b["rollout_logp"], b["mask"], c.low, c.high)
    if c.kind == "icepop":
        return algo.icepop_weights(b["old_logp"], b["rollout_logp"], b["mask"], c.low, c.high)
    if c.kind == "mis":
        return algo.mis_weights(b["old_logp"], b["rollout_logp"], b["mask"], c.level, c.mode, c.low, c.high,
                                c.veto_threshold)
    return None


def policy_token_loss(cfg: AlgorithmConfig, logp: torch.Tensor, b: Batch):
    """(loss [B,T], clipped [B,T], ratio [B,T]) of the configured policy objective."""
    if cfg.name == "gspo":
        return algo.gspo_policy_loss(logp, b["old_logp"], b["advantages"], b["mask"], cfg.eps_clip_low,
                                     cfg.eps_clip_high, dual_clip_c=cfg.dual_clip_c)
    if cfg.name == "cispo":
        return algo.cispo_loss(logp, b["old_logp"], b["advantages"], cfg.eps_clip_low, cfg.eps_clip_high)
    return algo.clipped_policy_loss(logp, b["old_logp"], b["advantages"], cfg.eps_clip_low, cfg.eps_clip_high,
                                    dual_clip_c=cfg.dual_clip_c)


def policy_loss(cfg: AlgorithmConfig, logp: torch.Tensor, entropy: torch.Tensor | None, mb: Batch,
                totals: dict[str, float], max_new_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the batch loss: agg(policy loss * IS weight) - entropy bonus
    + KL loss, with the global token/sequence counts as denominators (gradient accumulation)."""
    mask = mb["mask"]
    token_loss, clipped, _ = policy_token_loss(cfg, logp, mb)

    def agg(values: torch.Tensor) -> torch.Tensor:
        return algo.aggregate(values, mask, cfg.loss_aggregation, max_new_tokens,
                              num_tokens=totals["num_tokens"], num_seqs=totals["num_seqs"])

    loss = agg(token_loss * mb["is_weights"])
    parts = {"train/pg_loss": float(loss.detach()), "train/clip_frac": float(agg(clipped)),
             "train/ppo_kl": float(agg(mb["old_logp"] - logp.detach()))}
    if entropy is not None:
        ent = agg(entropy)
        loss = loss - cfg.entropy_coef * ent
        parts["train/entropy"] = float(ent.detach())
    if cfg.kl_loss_coef > 0:
        kl = agg(algo.kl_estimate(logp, mb["ref_logp"], cfg.kl_estimator))
        loss = loss + cfg.kl_loss_coef * kl
        parts["train/kl_loss"] = float(kl.detach())
    parts[TRAIN_LOSS] = float(loss.detach())
    return loss, parts
