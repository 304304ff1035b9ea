"""The embedded engine's per-request seeded sampling: a pure function of (seed, step, token),
and a sample of the softmax it is given (checked by a chi-square test)."""

import torch

from miles_core.engines.embedded.engine import SeededSampling
from miles_core.engines.embedded.slot_decoder import counter_uniform

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
CHI2_999_3DOF = 16.27  # 99.9% quantile of chi-square with 3 degrees of freedom


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_uniforms_are_a_function_of_seed_step_and_token():
    seeds = torch.tensor([3, 4, 3])
    u = counter_uniform(seeds, 5, 1000)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert torch.equal(counter_uniform(seeds[:1], 5, 1000)[0], u[0])  # the batch around a row does not matter
    assert not torch.equal(counter_uniform(seeds[:1], 6, 1000)[0], u[0])
    per_row = counter_uniform(seeds, torch.tensor([5, 6, 5]), 1000)  # each row at its own step
    assert torch.equal(per_row[0], u[0]) and torch.equal(per_row[1], counter_uniform(seeds[1:2], 6, 1000)[0])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02


def test_rows_sample_the_softmax_across_seeds_and_steps():
    probs = torch.softmax(LOGITS, -1)[0]
    rows = 20_000
    picks = SeededSampling(list(range(rows)), temperature=1.0)(None, LOGITS.expand(rows, 4).clone()).argmax(-1)
    assert chi_square(torch.bincount(picks, minlength=4).float(), probs) < CHI2_999_3DOF
    one_seed = SeededSampling([7], temperature=1.0)
    picks = torch.cat([one_seed(None, LOGITS.clone()).argmax(-1) for _ in range(5_000)])
    assert chi_square(torch.bincount(picks, minlength=4).float(), probs) < CHI2_999_3DOF


def test_temperature_and_top_k_shape_the_distribution():
    rows = 4_000
    cold = SeededSampling(list(range(rows)), temperature=0.25)(None, LOGITS.expand(rows, 4).clone()).argmax(-1)
    assert (cold == 0).float().mean() > 0.95  # softmax(4 * logits)[0] = 0.98
    top2 = SeededSampling(list(range(rows)), temperature=1.0, top_k=2)(None, LOGITS.expand(rows, 4).clone()).argmax(-1)
    assert set(top2.tolist()) == {0, 1}
