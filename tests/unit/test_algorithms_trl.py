"""GRPO-family losses against TRL's own implementation on identical crafted tensors.

TRL is a test-only dependency (pinned in the `test` extra; checked with trl 1.16.0). We call
the real `GRPOTrainer._compute_loss` on an instance built with `object.__new__` (no __init__,
no model download): only the attributes that method reads are set, and the stub model
returns our crafted per-token log-probs, which is what TRL's fused-LM-head forward returns
(`outputs.log_probs`). Everything runs in float64 (TRL does not force a dtype here).

Mapping verified in trl/trainer/grpo_trainer.py (`_compute_loss`):
  grpo    -> seq_mean_token_mean            (per-sequence token mean, then batch mean)
  bnpo    -> token_mean                     (local token count)
  dapo    -> token_mean with num_tokens = num_items_in_batch (global token count)
  dr_grpo -> seq_mean_token_sum_norm with max_len = max_completion_length
  importance_sampling_level="sequence" + grpo -> GSPO;  cispo -> cispo_loss + token_mean
  (TRL's CISPO clamps rho at `epsilon_high` as an absolute bound with no lower bound: ours
  with eps_high = trl_epsilon_high - 1 and eps_low = 1, i.e. a lower bound of 0).
TRL adds beta * k3(logp, ref) per token before aggregating, = our agg(L) + beta * agg(k3).
"""

import contextlib
import types
from collections import defaultdict

import pytest
import torch

from miles_core import algorithms as algo

trl = pytest.importorskip("trl")
GRPOTrainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer

B, P, T, MAX_LEN = 6, 3, 8, 10
TOL = 1e-6


class _Accelerator:
    """Single-process stand-in for accelerate.Accelerator: the collectives are identities."""

    num_processes, is_main_process, sync_gradients = 1, True, True

    def autocast(self):
        return contextlib.nullcontext()

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


class _StubModel:
    """Forward returns the crafted completion log-probs (prompt positions are never read)."""

    training = True

    def __init__(self, completion_logp):
        self.completion_logp = completion_logp

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, **_):
        assert fused_lm_head and input_ids.shape == (B, P + T)
        pad = torch.zeros(B, P, dtype=self.completion_logp.dtype)
        return types.SimpleNamespace(log_probs=torch.cat([pad, self.completion_logp], dim=1),
                                     entropy=torch.zeros(B, P + T, dtype=self.completion_logp.dtype))


def _trainer(loss_type, eps_low, eps_high, beta, level="token"):
    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
        importance_sampling_level=level, top_entropy_quantile=1.0, aux_loss_enabled=False,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=_Accelerator(), state=types.SimpleNamespace(global_step=0),
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1,
                                   report_to=[]),
        model=types.SimpleNamespace(training=True),
    )
    return trainer


def _crafted():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([8, 5, 3, 8, 6, 1])
    completion_mask = (torch.arange(T) < lengths[:, None]).long()  # right padding, as TRL builds it
    logp = -torch.rand(B, T, dtype=torch.float64, generator=g) * 2 - 0.1
    old = logp + torch.randn(B, T, dtype=torch.float64, generator=g) * 0.3  # clips on both sides
    old = old + torch.tensor([0.5, -0.4, 0.0, 0.1, -0.05, 0.3], dtype=torch.float64)[:, None]  # and GSPO
    ref = logp + torch.randn(B, T, dtype=torch.float64, generator=g) * 0.1
    adv = torch.randn(B, dtype=torch.float64, generator=g)
    return completion_mask, logp, old, ref, adv


def _trl_loss(trainer, logp, completion_mask, old, ref, adv, num_items):
    inputs = {
        "prompt_ids": torch.ones(B, P, dtype=torch.long), "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": completion_mask,
        "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(num_items), dtype=torch.float64),
    }
    return trainer._compute_loss(_StubModel(logp), inputs)


CASES = {
    # id: (trl loss_type, IS level, our loss fn, aggregation, aggregate kwargs, beta)
    "grpo": ("grpo", "token", "ppo", "seq_mean_token_mean", {}, 0.04),
    "bnpo": ("bnpo", "token", "ppo", "token_mean", {}, 0.0),
    "dapo": ("dapo", "token", "ppo", "token_mean", {"num_tokens": 40.0}, 0.0),
    "dr_grpo": ("dr_grpo", "token", "ppo", "seq_mean_token_sum_norm", {"max_len": MAX_LEN}, 0.04),
    "gspo": ("grpo", "sequence", "gspo", "seq_mean_token_mean", {}, 0.0),
    "cispo": ("cispo", "token", "cispo", "token_mean", {"num_tokens": 40.0}, 0.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_matches_trl(case):
    loss_type, level, ours, mode, agg_kwargs, beta = CASES[case]
    eps_low, eps_high = 0.2, 0.28
    completion_mask, logp0, old, ref, adv = _crafted()
    mask = completion_mask.double()

    trl_logp = logp0.clone().requires_grad_(True)
    trl_eps_high = 1 + eps_high if loss_type == "cispo" else eps_high
    trainer = _trainer(loss_type, eps_low, trl_eps_high, beta, level)
    trl_loss = _trl_loss(trainer, trl_logp, completion_mask, old, ref, adv, agg_kwargs.get("num_tokens", 0))
    trl_loss.backward()

    logp = logp0.clone().requires_grad_(True)
    a = adv.unsqueeze(1)
    if ours == "ppo":
        token_loss, clipped, _ = algo.clipped_policy_loss(logp, old, a, eps_low, eps_high)
    elif ours == "gspo":
        token_loss, clipped, _ = algo.gspo_policy_loss(logp, old, a, mask, eps_low, eps_high)
    else:
        token_loss, clipped, _ = algo.cispo_loss(logp, old, a, 1.0, eps_high)
    loss = algo.aggregate(token_loss, mask, mode, **agg_kwargs)
    if beta:
        loss = loss + beta * algo.aggregate(algo.kl_estimate(logp, ref, "k3"), mask, mode, **agg_kwargs)
    loss.backward()

    assert trl_loss.dtype == torch.float64
    assert abs(trl_loss.item() - loss.item()) <= TOL, (trl_loss.item(), loss.item())
    assert (trl_logp.grad - logp.grad).abs().max().item() <= TOL
    metrics = trainer._metrics["train"]
    if loss_type != "cispo":  # TRL's clip region = ours: rho beyond the bound in the direction of A
        # (TRL averages a sequence-level ratio's flag over sequences, a token ratio's over tokens)
        frac = clipped[:, 0].mean() if level == "sequence" else algo.aggregate(clipped, mask, "token_mean")
        assert abs(metrics["clip_ratio/region_mean"][0] - frac.item()) <= TOL
        assert 0 < metrics["clip_ratio/region_mean"][0] < 1
    if beta:
        kl = algo.aggregate(algo.kl_estimate(logp0, ref, "k3"), mask, "token_mean")
        assert abs(metrics["kl"][0] - kl.item()) <= TOL


def test_trl_version_pinned():
    # The mapping above was read from this TRL version's source; re-check it when bumping.
    assert trl.__version__ == "1.16.0"
