"""The `algorithm` section: objective, advantages, clipping, KL, and mismatch correction."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles_core.config.base import Section


class CorrectionConfig(Section):
    kind: Literal["none", "tis", "icepop", "mis"] = "none"
    """Rollout/trainer mismatch correction: truncated IS (tis), IcePop (zero weight outside
    [low, high]), or MIS/rejection sampling (mis, see level/mode). Metrics are always logged."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """MIS ratio level: per token, per sequence (exp of the sum), or geometric (exp of the mean)."""
    mode: Literal["truncate", "clip", "mask"] = "truncate"
    """MIS weight mode: min(w, high), clamp(w, low, high), or w inside [low, high] else 0."""
    low: float = Field(0.0, ge=0)
    """Lower bound of the importance weight."""
    high: float = Field(2.0, gt=0)
    """Upper bound of the importance weight."""
    veto_threshold: float | None = Field(None, gt=0)
    """MIS veto: drop a whole sequence if any token ratio is below this."""


ALGORITHMS = ("grpo", "gspo", "cispo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "opd", "sft")
GROUP_ALGORITHMS = ("grpo", "gspo", "cispo", "reinforce_pp_baseline")
KL_IN_REWARD_ALGORITHMS = ("ppo", "reinforce_pp", "reinforce_pp_baseline")


class AlgorithmConfig(Section):
    name: Literal["grpo", "gspo", "cispo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "opd", "sft"] = "grpo"
    """Objective: grpo, gspo (sequence ratio), cispo, ppo (critic + GAE), reinforce_pp,
    reinforce_pp_baseline, opd (on-policy distillation from algorithm.teacher_source), sft."""
    normalize_std: bool = True
    """Group advantages divided by the group std (False gives Dr.GRPO)."""
    group_normalize: bool = True
    """Subtract the group mean from rewards (False uses raw rewards as advantages)."""
    eps_clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower PPO clip range: ratios below 1 - eps_clip_low are clipped."""
    eps_clip_high: float = Field(0.28, ge=0)
    """Upper PPO clip range (clip-higher): ratios above 1 + eps_clip_high are clipped."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL(actor || reference) loss term (GRPO style)."""
    kl_in_reward_coef: float = Field(0.0, ge=0)
    """beta of the KL penalty folded into token rewards (PPO / REINFORCE++ style)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of both KL forms."""
    ref_refresh_interval_steps: int = Field(0, ge=0)
    """Copy the policy into the reference model every this many steps; 0 keeps the initial one."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """Reduction of token losses: mean over all tokens of the batch (default), mean of
    per-sequence means, or mean of per-sequence sums over max_new_tokens (Dr.GRPO)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of PPO/GAE and REINFORCE++ returns."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    critic: Literal["auto", "none", "value_head"] = "auto"
    """Critic model: auto (a value head for ppo, none otherwise), none, or value_head."""
    critic_lr: float = Field(1e-3, gt=0)
    """Learning rate of the critic."""
    value_clip: float = Field(0.2, gt=0)
    """Value clipping range around the old values."""
    critic_warmup_steps: int = Field(0, ge=0)
    """First steps that train only the critic (policy frozen)."""
    correction: CorrectionConfig = CorrectionConfig()
    """Importance correction for rollout/trainer mismatch (needed when rollouts are off-policy)."""
    opd_coef: float = Field(0.0, ge=0)
    """On-policy distillation weight: A_t -= opd_coef * (logp_student - logp_teacher); set
    automatically to 1.0 for name=opd when left at 0."""
    teacher_source: str | None = None
    """Teacher model for distillation: a model source like model.source, or `warmup` for the
    SFT warm-up's result (the student then starts from model.source untouched)."""
    old_logprob_source: Literal["trainer", "rollout"] = "trainer"
    """Log-probs the PPO ratio is taken against: recomputed by the trainer before the update
    (optionally weighted by algorithm.correction), or the rollout engine's (the behaviour policy:
    the ratio itself corrects off-policy samples of async loops; no correction on top)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal, over-sample until full."""
    max_sampling_rounds: int = Field(4, ge=1)
    """Rollout rounds per step at most when dynamic sampling keeps too few groups."""
    short_batch: Literal["train", "fail"] = "train"
    """Dynamic sampling, when max_sampling_rounds run out before the batch is full: train on
    the groups kept (a warning, and rollout/short_batch = 1 in the step's metrics) or fail the
    run. A step that kept no group always fails."""

    @property
    def uses_critic(self) -> bool:
        return self.critic == "value_head" or (self.critic == "auto" and self.name == "ppo")

    @property
    def effective_opd_coef(self) -> float:
        return self.opd_coef or (1.0 if self.name == "opd" else 0.0)

    @model_validator(mode="after")
    def _combinations(self) -> AlgorithmConfig:
        if self.kl_loss_coef > 0 and self.kl_in_reward_coef > 0:
            raise ValueError("KL as a loss and KL in the reward are exclusive: set kl_loss_coef or "
                             "kl_in_reward_coef to 0")
        if self.kl_in_reward_coef > 0 and self.name not in KL_IN_REWARD_ALGORITHMS:
            raise ValueError(f"kl_in_reward_coef applies to {KL_IN_REWARD_ALGORITHMS}; for {self.name} "
                             "use kl_loss_coef")
        if self.name == "ppo" and self.critic == "none":
            raise ValueError("PPO needs a critic: set algorithm.critic=value_head (or auto)")
        if self.name == "gspo" and self.correction.kind in ("tis", "icepop") or (
                self.name == "gspo" and self.correction.kind == "mis" and self.correction.level == "token"):
            raise ValueError("GSPO uses a sequence-level ratio: token-level corrections do not apply; set "
                             "algorithm.correction.kind=mis with level=sequence or geometric")
        if (self.name == "opd" or self.opd_coef > 0) and not self.teacher_source:
            raise ValueError("distillation needs a teacher: set algorithm.teacher_source (a model source or 'warmup')")
        if self.old_logprob_source == "rollout" and self.correction.kind != "none":
            raise ValueError("algorithm.old_logprob_source=rollout takes the PPO ratio against the rollout log-probs, "
                             "which already corrects the rollout/trainer mismatch; a correction weight on top counts it "
                             "twice: set algorithm.correction.kind=none, or old_logprob_source=trainer to keep the "
                             f"{self.correction.kind} correction")
        if self.correction.low >= self.correction.high:
            raise ValueError("algorithm.correction.low must be below correction.high")
        return self
