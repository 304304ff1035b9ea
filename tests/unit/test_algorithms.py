import math

import torch

from miles_core import algorithms as algo


def test_grpo_advantages_match_loop():
    torch.manual_seed(0)
    rewards = torch.rand(12, dtype=torch.float64)
    rewards[4:8] = 1.0  # a zero-std group: centred only
    got = algo.grpo_advantages(rewards, group_size=4)
    for g in range(3):
        group = rewards[4 * g : 4 * g + 4].tolist()
        mean = sum(group) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 3)
        for i, r in enumerate(group):
            want = (r - mean) / (std + 1e-6) if std > 0 else r - mean
            assert abs(got[4 * g + i].item() - want) <= 1e-9
    dr = algo.grpo_advantages(rewards, 4, normalize_std=False)
    assert torch.allclose(dr[:4], rewards[:4] - rewards[:4].mean())


def test_clipped_loss_matches_formula_loop():
    torch.manual_seed(1)
    logp = torch.randn(3, 5, dtype=torch.float64) * 0.3
    old = logp + torch.randn(3, 5, dtype=torch.float64) * 0.3
    adv = torch.randn(3, 1, dtype=torch.float64).expand(3, 5)
    loss, clipped, _ = algo.clipped_policy_loss(logp, old, adv, 0.2, 0.28)
    for b in range(3):
        for t in range(5):
            rho = math.exp(logp[b, t] - old[b, t])
            a = adv[b, t].item()
            want = max(-rho * a, -min(max(rho, 0.8), 1.28) * a)
            assert abs(loss[b, t].item() - want) <= 1e-12


def test_aggregations_and_microbatch_sums():
    torch.manual_seed(2)
    values = torch.randn(4, 6, dtype=torch.float64)
    mask = (torch.rand(4, 6) > 0.3).double()
    mask[:, 0] = 1
    token_mean = (values * mask).sum() / mask.sum()
    assert torch.isclose(algo.aggregate(values, mask, "token_mean"), token_mean)
    seq = sum(((values[i] * mask[i]).sum() / mask[i].sum()) for i in range(4)) / 4
    assert torch.isclose(algo.aggregate(values, mask, "seq_mean_token_mean"), seq)
    norm = sum((values[i] * mask[i]).sum() / 8 for i in range(4)) / 4
    assert torch.isclose(algo.aggregate(values, mask, "seq_mean_token_sum_norm", max_len=8), norm)
    for mode in algo.AGGREGATIONS:  # two micro-batches with global denominators sum to the whole
        whole = algo.aggregate(values, mask, mode, 8)
        parts = sum(algo.aggregate(values[s], mask[s], mode, 8, num_tokens=float(mask.sum()), num_seqs=4.0)
                    for s in (slice(0, 1), slice(1, 4)))
        assert torch.isclose(whole, parts), mode


def test_kl_estimators_zero_at_equal_policies():
    x = torch.randn(10, dtype=torch.float64)
    for kind in ("k1", "k2", "k3"):
        assert torch.count_nonzero(algo.kl_estimate(x, x, kind)) == 0
    y = x - 0.1
    assert torch.allclose(algo.kl_estimate(x, y, "k3"), torch.exp(-(x - y)) - 1 + (x - y))
