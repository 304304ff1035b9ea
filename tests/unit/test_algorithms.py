import math

import pytest
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
    y = x - 0.1 * torch.rand(10, dtype=torch.float64)
    assert torch.allclose(algo.kl_estimate(x, y, "k1"), x - y)
    assert torch.allclose(algo.kl_estimate(x, y, "k2"), 0.5 * (x - y) ** 2)
    assert torch.allclose(algo.kl_estimate(x, y, "k3"), torch.exp(-(x - y)) - 1 + (x - y))


# ---------------------------------------------------------------------------------------------
# Extended objectives: each compared with a plain Python loop written from its docstring formula
# (float64, random inputs, masks with right padding and holes in the middle).

TOL = 1e-6


def _mask(B, T, seed, holes=True):
    """Float mask [B, T]: a random span per row, with a hole in the middle of some rows."""
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        start = int(torch.randint(0, 2, (1,), generator=g))
        end = int(torch.randint(start + 3, T + 1, (1,), generator=g))
        m[b, start:end] = 1
        if holes and b % 2 == 1 and end - start >= 5:
            m[b, start + 2 : start + 4] = 0  # e.g. a tool observation inside the response
    return m


def _rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * scale


def _on(mask, b):
    return [t for t in range(mask.shape[1]) if mask[b, t] > 0]


def _whiten_loop(values, mask):
    xs = [values[b][t] for b in range(len(values)) for t in range(len(values[b])) if mask[b, t] > 0]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / len(xs)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in _on(mask, b):
            out[b, t] = (values[b][t] - mean) / math.sqrt(var + 1e-8)
    return out


def _max_err(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (a - b).abs().max().item()


def test_masked_whiten_loop_and_moments():
    mask = _mask(5, 9, seed=10)
    values = _rand(5, 9, seed=11, scale=3.0) + 7.0
    values[mask == 0] = float("nan")  # padding content must not leak into the statistics
    got = algo.masked_whiten(values, mask)
    assert _max_err(got, _whiten_loop(values.tolist(), mask)) <= TOL
    n = mask.sum()
    mean = (got * mask).sum() / n
    var = ((got - mean) ** 2 * mask).sum() / n
    assert abs(mean.item()) <= 1e-9 and abs(var.item() - 1) <= 1e-6
    assert torch.count_nonzero(got[mask == 0]) == 0
    got32 = algo.masked_whiten(values.float() + 1000.0, mask.float())  # float64 stats: no cancellation
    assert got32.dtype == torch.float32 and _max_err(got32, got) <= 1e-4


def test_reinforce_pp_returns_match_loop():
    B, T, beta, gamma = 6, 9, 0.1, 0.9
    mask, rewards, kl = _mask(B, T, seed=20), _rand(B, seed=21), _rand(B, T, seed=22, scale=0.1)
    got = algo.reinforce_pp_returns(rewards, mask, kl, beta, gamma)
    G = [[0.0] * T for _ in range(B)]
    for b in range(B):
        on = _on(mask, b)
        rew = {t: -beta * kl[b, t].item() for t in on}
        rew[on[-1]] += rewards[b].item()
        for j, t in enumerate(on):  # k - t counted over trainable tokens
            G[b][t] = sum(gamma ** (k - j) * rew[on[k]] for k in range(j, len(on)))
    assert _max_err(got, _whiten_loop(G, mask)) <= TOL
    no_kl = algo.reinforce_pp_returns(rewards, mask, None, beta, gamma)
    assert _max_err(no_kl, algo.reinforce_pp_returns(rewards, mask, kl, 0.0, gamma)) <= TOL


def test_reinforce_pp_baseline_match_loop():
    B, T, n, beta = 8, 7, 4, 0.05
    mask, rewards, kl = _mask(B, T, seed=30), _rand(B, seed=31), _rand(B, T, seed=32, scale=0.2)
    got = algo.reinforce_pp_baseline_advantages(rewards, n, mask, kl, beta)
    A = [[0.0] * T for _ in range(B)]
    for b in range(B):
        g = b // n
        mean = sum(rewards[g * n + i].item() for i in range(n)) / n
        for t in _on(mask, b):
            A[b][t] = rewards[b].item() - mean - beta * kl[b, t].item()
    assert _max_err(got, _whiten_loop(A, mask)) <= TOL


def _gae_loop(rewards, values, mask, kl, beta, gamma, lam):
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        on = _on(mask, b)
        if not on:
            continue
        rew = {t: -beta * kl[b, t].item() for t in on}
        rew[on[-1]] += rewards[b].item()
        next_v, next_a = 0.0, 0.0  # V after the end = 0
        for t in reversed(on):
            delta = rew[t] + gamma * next_v - values[b, t].item()
            next_a = delta + gamma * lam * next_a
            next_v = values[b, t].item()
            adv[b, t] = next_a
    return adv, (adv + values) * mask


def test_gae_match_loop():
    B, T, beta, gamma, lam = 6, 10, 0.1, 0.95, 0.9
    mask, rewards = _mask(B, T, seed=40), _rand(B, seed=41)
    values, kl = _rand(B, T, seed=42), _rand(B, T, seed=43, scale=0.1)
    mask[5] = 0  # an empty row must not break anything
    adv, ret = algo.gae_advantages(rewards, values, mask, kl, beta, gamma, lam)
    want_adv, want_ret = _gae_loop(rewards, values, mask, kl, beta, gamma, lam)
    assert _max_err(adv, want_adv) <= TOL and _max_err(ret, want_ret) <= TOL
    assert torch.count_nonzero(adv[5]) == 0


def test_gae_mask_hole_does_not_decay():
    # The same trajectory with and without a masked hole: trainable tokens must agree exactly.
    gamma, lam = 0.9, 0.8
    v = torch.tensor([[0.3, -0.2, 0.5, 0.1]], dtype=torch.float64)
    full, full_mask = torch.zeros(1, 7, dtype=torch.float64), torch.zeros(1, 7, dtype=torch.float64)
    full[0, [0, 1, 4, 5]] = v[0]
    full[0, [2, 3]] = 123.0  # value predictions on the hole are ignored
    full_mask[0, [0, 1, 4, 5]] = 1
    r = torch.tensor([1.0], dtype=torch.float64)
    adv_hole, ret_hole = algo.gae_advantages(r, full, full_mask, None, 0.0, gamma, lam)
    adv_dense, ret_dense = algo.gae_advantages(r, v, torch.ones_like(v), None, 0.0, gamma, lam)
    assert _max_err(adv_hole[0, [0, 1, 4, 5]], adv_dense[0]) <= 1e-12
    assert _max_err(ret_hole[0, [0, 1, 4, 5]], ret_dense[0]) <= 1e-12
    assert torch.count_nonzero(adv_hole[0, [2, 3, 6]]) == 0
    g_hole = algo.reinforce_pp_returns(r.repeat(2), full_mask.repeat(2, 1), None, 0.0, gamma)
    g_dense = algo.reinforce_pp_returns(r.repeat(2), torch.ones(2, 4, dtype=torch.float64), None, 0.0, gamma)
    assert _max_err(g_hole[:, [0, 1, 4, 5]], g_dense) <= 1e-9


def test_value_loss_match_loop():
    B, T, c = 5, 8, 0.2
    mask = _mask(B, T, seed=50)
    values, old, ret = _rand(B, T, seed=51), _rand(B, T, seed=52), _rand(B, T, seed=53)
    got = algo.value_loss(values, old, ret, mask, c)
    total, n = 0.0, 0
    for b in range(B):
        for t in _on(mask, b):
            v, vo, R = values[b, t].item(), old[b, t].item(), ret[b, t].item()
            vc = min(max(v, vo - c), vo + c)
            total += max((vc - R) ** 2, (v - R) ** 2)
            n += 1
    assert abs(got.item() - total / n) <= TOL
    plain = sum((values[b, t].item() - ret[b, t].item()) ** 2 for b in range(B) for t in _on(mask, b)) / n
    assert abs(algo.value_loss(values, old, ret, mask, None).item() - plain) <= TOL


def _ppo_token(rho, a, el, eh):
    return max(-rho * a, -min(max(rho, 1 - el), 1 + eh) * a)


def test_gspo_match_loop():
    B, T, el, eh = 6, 8, 0.2, 0.28
    mask = _mask(B, T, seed=60)
    logp = _rand(B, T, seed=61, scale=0.5) - 1
    old = logp + _rand(B, T, seed=62, scale=0.3) + _rand(B, 1, seed=64, scale=0.4)
    adv = _rand(B, seed=63).unsqueeze(1)
    loss, clipped, ratio = algo.gspo_policy_loss(logp, old, adv, mask, el, eh)
    assert loss.shape == clipped.shape == ratio.shape == (B, T)
    assert clipped[:, 0].any() and not clipped[:, 0].all()  # both branches are exercised
    for b in range(B):
        on = _on(mask, b)
        s = sum(logp[b, t].item() - old[b, t].item() for t in on) / len(on)
        rho, a = math.exp(s), adv[b, 0].item()
        for t in range(T):
            assert abs(ratio[b, t].item() - rho) <= TOL
            assert abs(loss[b, t].item() - _ppo_token(rho, a, el, eh)) <= TOL
            assert clipped[b, t].item() == float(_ppo_token(rho, a, el, eh) != -rho * a)


def test_dual_clip_matches_loop_and_only_touches_negative_advantages():
    B, T, el, eh, c = 6, 8, 0.2, 0.28, 3.0
    logp = _rand(B, T, seed=70, scale=0.3)
    old = logp + _rand(B, T, seed=71, scale=1.5)  # large ratios so the dual clip binds
    adv = _rand(B, T, seed=72)
    base, base_clip, _ = algo.clipped_policy_loss(logp, old, adv, el, eh)
    same, same_clip, _ = algo.clipped_policy_loss(logp, old, adv, el, eh, dual_clip_c=None)
    assert torch.equal(base, same) and torch.equal(base_clip, same_clip)  # default unchanged
    dual, dual_clip, _ = algo.clipped_policy_loss(logp, old, adv, el, eh, dual_clip_c=c)
    for b in range(B):
        for t in range(T):
            rho, a = math.exp(logp[b, t] - old[b, t]), adv[b, t].item()
            want = _ppo_token(rho, a, el, eh)
            if a < 0:
                want = min(want, -c * a)
            assert abs(dual[b, t].item() - want) <= TOL
    changed = dual != base
    assert changed.any() and bool((adv[changed] < 0).all())
    assert torch.equal(dual[adv >= 0], base[adv >= 0])
    assert bool((dual_clip >= base_clip).all())
    with pytest.raises(ValueError):
        algo.clipped_policy_loss(logp, old, adv, el, eh, dual_clip_c=1.0)


def test_cispo_match_loop_and_stopgrad():
    B, T, el, eh = 4, 6, 0.2, 0.28
    logp = (_rand(B, T, seed=80, scale=0.3) - 1).requires_grad_(True)
    old = logp.detach() + _rand(B, T, seed=81, scale=0.4)
    adv = _rand(B, seed=82).unsqueeze(1)
    loss, clipped, ratio = algo.cispo_loss(logp, old, adv, el, eh)
    loss.sum().backward()
    for b in range(B):
        for t in range(T):
            rho, a, lp = math.exp(logp[b, t].item() - old[b, t].item()), adv[b, 0].item(), logp[b, t].item()
            w = min(max(rho, 1 - el), 1 + eh)
            assert abs(loss[b, t].item() - (-w * a * lp)) <= TOL
            assert abs(logp.grad[b, t].item() - (-w * a)) <= TOL  # d/dlogp sees no ratio gradient
            assert clipped[b, t].item() == float(rho < 1 - el or rho > 1 + eh)


def test_tis_and_icepop_match_loop():
    B, T = 5, 8
    mask = _mask(B, T, seed=90)
    train = _rand(B, T, seed=91, scale=0.5) - 1
    roll = train + _rand(B, T, seed=92, scale=0.8)
    tis = algo.tis_weights(train, roll, mask)
    ice = algo.icepop_weights(train, roll, mask, low=0.5, high=2.0)
    for b in range(B):
        for t in range(T):
            r = math.exp(train[b, t] - roll[b, t])
            on = mask[b, t].item()
            assert abs(tis[b, t].item() - on * min(max(r, 0.0), 2.0)) <= TOL
            assert abs(ice[b, t].item() - on * (r if 0.5 <= r <= 2.0 else 0.0)) <= TOL
    assert (ice == 0).logical_and(mask > 0).any()  # the test data does exercise the rejection


def _mis_loop(train, roll, mask, level, mode, low, high, veto):
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        on = _on(mask, b)
        d = {t: train[b, t].item() - roll[b, t].item() for t in on}
        vetoed = veto is not None and any(math.exp(d[t]) < veto for t in on)
        for t in on:
            if level == "token":
                w = math.exp(d[t])
            elif level == "sequence":
                w = math.exp(sum(d.values()))
            else:
                w = math.exp(sum(d.values()) / len(on))
            if mode == "truncate":
                w = min(w, high)
            elif mode == "clip":
                w = min(max(w, low), high)
            else:
                w = w if low <= w <= high else 0.0
            out[b, t] = 0.0 if vetoed else w
    return out


@pytest.mark.parametrize("level", algo.MIS_LEVELS)
@pytest.mark.parametrize("mode", algo.MIS_MODES)
def test_mis_weights_match_loop(level, mode):
    B, T = 6, 7
    mask = _mask(B, T, seed=100)
    train = _rand(B, T, seed=101, scale=0.5) - 1
    roll = train + _rand(B, T, seed=102, scale=0.3)
    nonzero = 0
    for low, high in ((0.8, 1.25), (0.3, 3.0)):
        for veto in (None, 0.7):
            got = algo.mis_weights(train, roll, mask, level, mode, low, high, veto)
            assert _max_err(got, _mis_loop(train, roll, mask, level, mode, low, high, veto)) <= TOL
            nonzero += int(got.count_nonzero())
    assert nonzero > 0  # real weights were compared, not only all-zero tensors


def test_mis_veto_zeroes_whole_sequences():
    mask = _mask(4, 6, seed=110, holes=False)
    train = torch.full((4, 6), -1.0, dtype=torch.float64)
    roll = train.clone()
    roll[1, 2] = train[1, 2] + 5.0  # ratio e^-5 on one token of sequence 1
    roll[2, 5] = train[2, 5] + 5.0  # ... and on a padded token of sequence 2: not a veto
    mask[2, 5] = 0
    w = algo.mis_weights(train, roll, mask, "token", "truncate", veto_threshold=1e-2)
    assert torch.count_nonzero(w[1]) == 0
    assert torch.equal(w[[0, 2, 3]], mask[[0, 2, 3]])


def test_mismatch_metrics_match_loop():
    B, T = 5, 8
    mask = _mask(B, T, seed=120)
    train = _rand(B, T, seed=121, scale=0.5) - 1
    roll = train + _rand(B, T, seed=122, scale=0.2)
    got = algo.mismatch_metrics(train, roll, mask)
    xs = [train[b, t].item() - roll[b, t].item() for b in range(B) for t in _on(mask, b)]
    want = {
        "mismatch/abs_ratio_minus_one": sum(abs(math.exp(x) - 1) for x in xs) / len(xs),
        "mismatch/kl": sum(math.exp(-x) - 1 + x for x in xs) / len(xs),
        "mismatch/logprob_abs_diff": sum(abs(x) for x in xs) / len(xs),
    }
    assert set(got) == set(want)
    for k in want:
        assert abs(got[k].item() - want[k]) <= TOL, k


def test_sft_loss_match_loop():
    B, T = 4, 6
    mask, logp = _mask(B, T, seed=130), _rand(B, T, seed=131).abs().neg()
    toks = [(b, t) for b in range(B) for t in _on(mask, b)]
    want = {
        "token_mean": sum(-logp[b, t].item() for b, t in toks) / len(toks),
        "seq_mean_token_mean": sum(sum(-logp[b, t].item() for t in _on(mask, b)) / len(_on(mask, b))
                                   for b in range(B)) / B,
        "seq_mean_token_sum_norm": sum(-logp[b, t].item() for b, t in toks) / (10 * B),
    }
    for mode, w in want.items():
        assert abs(algo.sft_loss(logp, mask, mode, max_len=10).item() - w) <= TOL, mode


def test_opd_adjust_advantages_match_loop():
    B, T, coef = 4, 6, 0.5
    mask = _mask(B, T, seed=140)
    adv, student, teacher = _rand(B, seed=141), _rand(B, T, seed=142) - 1, _rand(B, T, seed=143) - 1
    got = algo.opd_adjust_advantages(adv, student, teacher, mask, coef)
    for b in range(B):
        for t in range(T):
            want = (adv[b].item() - coef * (student[b, t].item() - teacher[b, t].item())) * mask[b, t].item()
            assert abs(got[b, t].item() - want) <= TOL
    per_token = algo.opd_adjust_advantages(adv.unsqueeze(1).expand(B, T), student, teacher, mask, coef)
    assert torch.equal(per_token, got)


def test_dynamic_sampling_keep_match_loop():
    rewards = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.25], dtype=torch.float64)
    got = algo.dynamic_sampling_keep(rewards, 4)
    want = [len(set(rewards[4 * g : 4 * g + 4].tolist())) > 1 for g in range(4)]
    assert got.dtype == torch.bool and got.tolist() == want == [False, True, False, True]


def test_step0_invariants():
    # actor == ref: every KL estimator, and the KL-in-reward terms, are exactly 0.
    B, T = 4, 7
    mask = _mask(B, T, seed=150)
    logp = _rand(B, T, seed=151).abs().neg()
    for kind in ("k1", "k2", "k3"):
        assert torch.count_nonzero(algo.kl_estimate(logp, logp.clone(), kind)) == 0
    metrics = algo.mismatch_metrics(logp, logp.clone(), mask)
    assert all(v.item() == 0 for v in metrics.values())
    # logp == logp_old: ratio exactly 1 and nothing clipped, for every policy loss.
    adv = _rand(B, T, seed=152)
    for _loss, clipped, ratio in (
        algo.clipped_policy_loss(logp, logp.clone(), adv, 0.2, 0.28),
        algo.clipped_policy_loss(logp, logp.clone(), adv, 0.2, 0.28, dual_clip_c=3.0),
        algo.gspo_policy_loss(logp, logp.clone(), adv, mask, 0.2, 0.28),
        algo.cispo_loss(logp, logp.clone(), adv, 0.2, 0.28),
    ):
        assert bool((ratio == 1).all()) and torch.count_nonzero(clipped) == 0
    loss, _, _ = algo.clipped_policy_loss(logp, logp.clone(), adv, 0.2, 0.28)
    assert torch.equal(loss, -adv)
    assert bool((algo.tis_weights(logp, logp.clone(), mask) == mask).all())


def _whiten_worker(rank, store_path, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        values, mask = _rank_data(rank)
        torch.save(algo.masked_whiten(values, mask, group=dist.group.WORLD), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _rank_data(rank):
    # Different sizes and distributions per rank, so local and global statistics differ.
    B = (3, 2)[rank]
    return _rand(B, 6, seed=160 + rank, scale=1.0 + 2 * rank) + 3 * rank, _mask(B, 6, seed=170 + rank)


@pytest.mark.timeout(60)
def test_masked_whiten_gloo_world_size_2(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_whiten_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    data = [_rank_data(r) for r in range(2)]
    whole = algo.masked_whiten(torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data]))
    for rank, part in enumerate(whole.split([3, 2])):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert _max_err(got, part) <= TOL
        assert _max_err(algo.masked_whiten(*data[rank]), part) > 1e-2  # local stats would differ
