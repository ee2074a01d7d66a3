"""clip_cov, kl_cov, geo_mean, k1+/k3+, token-sum and grpo_passk against straightforward float64
loop implementations written here (padding holds garbage; gradients compared with autograd)."""
import math

import pytest
import torch

from verl_hpc.algorithms import agg_loss, compute_advantages, compute_policy_loss, kl_estimate, kl_loss
from alg_options import adv_options, pg_options


D = torch.float64
LENGTHS = [5, 3, 4]
T = 6


def batch(seed=0, adv_per_seq=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS], dtype=D)
    old = -torch.rand(3, T, generator=g, dtype=D) * 2
    new = (old + 0.6 * torch.randn(3, T, generator=g, dtype=D))
    if adv_per_seq:
        adv = torch.randn(3, 1, generator=g, dtype=D).expand(3, T).clone()
    else:
        adv = torch.randn(3, T, generator=g, dtype=D)
    pad = mask == 0
    old[pad], new[pad], adv[pad] = float("inf"), float("nan"), float("nan")  # garbage on padding
    return old, new.requires_grad_(True), adv, mask


def valid_positions():
    return [(i, t) for i, n in enumerate(LENGTHS) for t in range(n)]


def loop_cov(adv, logp):
    pos = valid_positions()
    ma = sum(float(adv[i, t]) for i, t in pos) / len(pos)
    ml = sum(float(logp[i, t]) for i, t in pos) / len(pos)
    return {(i, t): (float(adv[i, t]) - ma) * (float(logp[i, t]) - ml) for i, t in pos}


def grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# ----------------------------------------------------------------------------------- clip_cov
def clip_cov_loop(old, new, adv, chosen, lo, hi):
    total = 0.0
    for i, t in valid_positions():
        if (i, t) in chosen:
            continue
        r = torch.exp(new[i, t] - old[i, t])
        a = float(adv[i, t])
        total = total + torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
    return total / len(valid_positions())


def test_clip_cov_all_candidates_selected_matches_loop_in_value_and_gradient():
    old, new, adv, mask = batch(1)
    lb, ub = 0.0, 100.0
    cov = loop_cov(adv, new.detach())
    chosen = set()
    for (i, t), c in cov.items():
        r = math.exp(float(new.detach()[i, t] - old[i, t]))
        a = float(adv[i, t])
        ppo_clipped = max(-a * r, -a * min(max(r, 0.8), 1.2)) > -a * r  # clipped term is the larger
        if lb < c < ub and not ppo_clipped:
            chosen.add((i, t))
    assert 0 < len(chosen) < len(cov)
    loss, m = compute_policy_loss("clip_cov", old, new, adv, mask, **pg_options(
        "clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub))
    new2 = new.detach().clone().requires_grad_(True)
    ref = clip_cov_loop(old, new2, adv, chosen, 0.2, 0.2)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad(loss, new), grad(ref, new2))
    assert m["clip_cov_frac"].item() == pytest.approx(len(chosen) / len(cov))


def test_clip_cov_draws_exactly_ratio_of_tokens_among_candidates():
    old, new, adv, mask = batch(2)
    torch.manual_seed(0)
    loss, m = compute_policy_loss("clip_cov", old, new, adv, mask,
                                  **pg_options("clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-100.0, clip_cov_ub=100.0))
    n = len(valid_positions())
    assert m["clip_cov_frac"].item() == pytest.approx(int(0.2 * n) / n)
    g = grad(loss, new)
    zero_grad = {(i, t) for i, t in valid_positions() if g[i, t] == 0}
    assert len(zero_grad) >= int(0.2 * n)  # the drawn ones, plus any PPO-clipped tokens
    with pytest.raises(ValueError, match="clip_cov_ratio must be in"):
        compute_policy_loss("clip_cov", old, new, adv, mask, **pg_options("clip_cov", clip_cov_ratio=0.0))


# ------------------------------------------------------------------------------------- kl_cov
@pytest.mark.parametrize("ratio,mode", [(0.25, "token-mean"), (0.01, "seq-mean-token-mean"),
                                        (0.5, "seq-mean-token-sum")])
def test_kl_cov_matches_loop_in_value_and_gradient(ratio, mode):
    old, new, adv, mask = batch(3)
    cov = loop_cov(adv, new.detach())
    k = max(int(ratio * len(cov)), 1)
    top = set(sorted(cov, key=lambda p: -cov[p])[:k])
    new2 = new.detach().clone().requires_grad_(True)
    per_seq = [0.0] * 3
    for i, t in valid_positions():
        d = new2[i, t] - old[i, t]
        term = -float(adv[i, t]) * torch.exp(d)
        if (i, t) in top:
            term = term + 0.7 * d.abs()
        per_seq[i] = per_seq[i] + term
    if mode == "token-mean":
        ref = sum(per_seq) / len(cov)
    elif mode == "seq-mean-token-mean":
        ref = sum(s / n for s, n in zip(per_seq, LENGTHS)) / 3
    else:
        ref = sum(per_seq) / 3
    loss, m = compute_policy_loss("kl_cov", old, new, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=0.7,
                                  loss_agg_mode=mode)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad(loss, new), grad(ref, new2))
    assert m["kl_cov_frac"].item() == pytest.approx(k / len(cov))


# ----------------------------------------------------------------------------------- geo_mean
def geo_mean_loop(old, new, adv, lo, hi):
    terms = []
    for i, n in enumerate(LENGTHS):
        acc, a_sum = 0.0, 0.0
        a_seq = sum(float(adv[i, t]) for t in range(n)) / n
        for t in range(n):
            a = float(adv[i, t])
            d = new[i, t] - old[i, t]
            dc = d.clamp(-lo, hi)
            s = (a > 0) - (a < 0)
            acc = acc + s * torch.minimum(s * d, s * dc)
        terms.append(-a_seq * torch.exp(acc / n))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("per_seq", [True, False])
def test_geo_mean_matches_loop_in_value_and_gradient(per_seq):
    old, new, adv, mask = batch(4, adv_per_seq=per_seq)
    loss, m = compute_policy_loss("geo_mean", old, new, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4,
                                  loss_agg_mode="token-mean")  # ignored: GMPO is a sequence mean
    new2 = new.detach().clone().requires_grad_(True)
    ref = geo_mean_loop(old, new2, adv, 0.4, 0.4)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad(loss, new), grad(ref, new2))
    d = (new.detach() - old)[mask > 0]
    assert bool(((d < -0.4) | (d > 0.4)).any())  # the piecewise (clipped) branch is exercised
    assert m["pg_clipfrac"].item() > 0


def test_geo_mean_micro_batch_contributions_sum_to_full_batch():
    old, new, adv, mask = batch(5, adv_per_seq=True)
    full, _ = compute_policy_loss("geo_mean", old, new, adv, mask)
    parts = [compute_policy_loss("geo_mean", old[r], new[r], adv[r], mask[r], global_seqs=3)[0]
             for r in ([0], [1, 2])]
    torch.testing.assert_close(sum(parts), full)


# ------------------------------------------------------------------------------ k1+ and k3+
@pytest.mark.parametrize("plus,base", [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_kl_has_base_value_and_k2_gradient(plus, base):
    _, logp, _, mask = batch(6)
    ref = -torch.rand(3, T, dtype=D)
    torch.testing.assert_close(kl_estimate(logp, ref, mask, plus), kl_estimate(logp, ref, mask, base))
    loss, _ = kl_loss(logp, ref, mask, 1.0, plus, "token-mean")
    g = grad(loss, logp)
    expected = torch.zeros(3, T, dtype=D)
    for i, t in valid_positions():  # d/dlogp of 0.5 (logp - ref)^2, token-mean
        expected[i, t] = (float(logp.detach()[i, t]) - float(ref[i, t])) / len(valid_positions())
    torch.testing.assert_close(g, expected)


# ---------------------------------------------------------------------------------- token-sum
def test_token_sum_is_plain_masked_sum_and_adds_over_micro_batches():
    _, x, _, mask = batch(7)
    x = x.detach()
    ref = sum(float(x[i, t]) for i, t in valid_positions())
    assert agg_loss(x, mask, "token-sum").item() == pytest.approx(ref, abs=1e-12)
    parts = agg_loss(x[:1], mask[:1], "token-sum") + agg_loss(x[1:], mask[1:], "token-sum", global_tokens=99)
    assert parts.item() == pytest.approx(ref, abs=1e-12)


# --------------------------------------------------------------------------------- grpo_passk
def passk_loop(scores, groups, norm, eps=1e-6):
    out = [0.0] * len(scores)
    for g in dict.fromkeys(groups):
        idx = [i for i, h in enumerate(groups) if h == g]
        vals = [scores[i] for i in idx]
        best = idx[vals.index(max(vals))]
        second = max(scores[i] for i in idx if i != best)
        a = scores[best] - second
        if norm:
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
            a = a / (std + eps)
        out[best] = a
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_loop(norm):
    scores = [0.2, 1.0, 0.5, 1.0, 0.0, 0.3, 0.9, 0.1]
    groups = ["a", "a", "b", "a", "b", "c", "c", "b"]  # group a has a tie at the maximum
    lengths = [3, 1, 2, 4, 2, 3, 1, 2]
    r = torch.zeros(8, 4, dtype=D)
    mask = torch.zeros(8, 4, dtype=D)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        r[i, n - 1] = s
    adv, ret = compute_advantages("grpo_passk", r, mask, group_ids=groups, **adv_options(norm_adv_by_std=norm))
    expected = passk_loop(scores, groups, norm)
    for i, n in enumerate(lengths):
        assert adv[i, :n].tolist() == pytest.approx([expected[i]] * n, abs=1e-12)
        assert torch.all(adv[i, n:] == 0)
    assert torch.equal(adv, ret)
    assert expected[1] == 0.0 and expected[3] == 0.0  # tie: margin 0 whichever is "best"
    with pytest.raises(ValueError, match=r"grpo_passk needs >= 2 samples per group.*rows \[2\]"):
        compute_advantages("grpo_passk", r[:3], mask[:3], group_ids=["a", "a", "b"], **adv_options())


# ------------------------------------------------------- rollout-correction weights, every loss
@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "gpg", "reinforce", "clip_cov", "kl_cov",
                                  "geo_mean"])
def test_rollout_is_weights_of_one_change_nothing_and_zero_drops_tokens(name):
    old, new, adv, mask = batch(8, adv_per_seq=True)
    torch.manual_seed(0)
    base, _ = compute_policy_loss(name, old, new, adv, mask, **pg_options(name))
    torch.manual_seed(0)
    same, _ = compute_policy_loss(name, old, new, adv, mask, **pg_options(name),
                                  rollout_is_weights=torch.ones(3, T, dtype=D))
    assert torch.equal(base, same)
    w = torch.ones(3, T, dtype=D)
    w[1] = 0.0  # a rejected sequence: no gradient reaches it
    torch.manual_seed(0)
    loss, _ = compute_policy_loss(name, old, new, adv, mask, **pg_options(name), rollout_is_weights=w)
    assert torch.all(grad(loss, new)[1] == 0)


def test_vanilla_with_truncated_weights_matches_loop():
    old, new, adv, mask = batch(9)
    w = torch.rand(3, T, dtype=D, generator=torch.Generator().manual_seed(1)) * 2
    loss, _ = compute_policy_loss("vanilla", old, new, adv, mask, **pg_options("vanilla", clip_ratio_c=None),
                                  rollout_is_weights=w)
    total = 0.0
    for i, t in valid_positions():
        r = math.exp(float(new.detach()[i, t] - old[i, t]))
        a = float(adv[i, t])
        total += float(w[i, t]) * max(-a * r, -a * min(max(r, 0.8), 1.2))
    assert loss.item() == pytest.approx(total / len(valid_positions()), rel=1e-12)
