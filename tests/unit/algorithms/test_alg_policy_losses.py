"""Policy and value losses: hand values, metrics, and gradients via torch.autograd."""
import math

import pytest
import torch

from verl_hpc.algorithms import compute_policy_loss, value_loss
from alg_options import CRITIC, pg_options


D = torch.float64
METRIC_KEYS = {"pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "pg_clipfrac_dual", "ppo_kl"}

# Five valid tokens and one padding token (garbage log-probs there must not matter).
# old_logp = 0 so ratio = exp(logp).
RATIOS = [1.5, 0.5, 1.1, 4.0, 0.7]
ADVS = [1.0, -1.0, 1.0, -1.0, 1.0]


def ppo_case():
    logp = torch.tensor([[math.log(r) for r in RATIOS] + [float("nan")]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.0] * 5 + [float("inf")]], dtype=D)
    adv = torch.tensor([ADVS + [float("nan")]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    return old, logp, adv, mask


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def test_vanilla_ppo_hand_values_metrics_and_gradients():
    old, logp, adv, mask = ppo_case()
    loss, m = compute_policy_loss(
        "vanilla", old, logp, adv, mask,
        **pg_options("vanilla", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    )
    # per token: A>0,r=1.5 -> -1.28 (clipped high); A<0,r=0.5 -> 0.8 (clipped low);
    # A>0,r=1.1 -> -1.1; A<0,r=4 -> min(4, 3) = 3 (dual clip); A>0,r=0.7 -> -0.7 (unclipped side)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1 + 3.0 - 0.7) / 5, abs=1e-12)
    assert set(m) == METRIC_KEYS
    assert m["pg_clipfrac_high"].item() == pytest.approx(0.2)
    assert m["pg_clipfrac_low"].item() == pytest.approx(0.2)
    assert m["pg_clipfrac"].item() == pytest.approx(0.4)
    assert m["pg_clipfrac_dual"].item() == pytest.approx(0.2)
    assert m["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in RATIOS) / 5, abs=1e-12)
    # d(-A r)/dlogp = -A r on unclipped tokens, exactly 0 where clipping (or dual clip) is active
    g = grad_of(loss, logp)
    expected = torch.tensor([[0.0, 0.0, -1.1 / 5, 0.0, -0.7 / 5, 0.0]], dtype=D)
    torch.testing.assert_close(g, expected, atol=1e-12, rtol=0)


def test_vanilla_without_dual_clip():
    old, logp, adv, mask = ppo_case()
    loss, m = compute_policy_loss(
        "vanilla", old, logp, adv, mask,
        **pg_options("vanilla", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    )
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1 + 4.0 - 0.7) / 5, abs=1e-12)
    assert m["pg_clipfrac_dual"].item() == 0.0
    assert grad_of(loss, logp)[0, 3].item() == pytest.approx(4.0 / 5)  # -A r with A = -1


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ppo_clip_zero_gradient_exactly_where_the_advantage_sign_says(sign):
    # a sweep of ratios on both sides of the clip range, one advantage sign at a time
    ratios = torch.linspace(0.3, 2.5, 23, dtype=D)
    logp = ratios.log().unsqueeze(0).requires_grad_(True)
    adv = torch.full_like(logp, sign)
    loss, _ = compute_policy_loss(
        "vanilla", torch.zeros_like(logp), logp, adv, torch.ones_like(logp),
        **pg_options("vanilla", clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=None),
    )
    g = grad_of(loss, logp)[0]
    clipped = (ratios > 1.3) if sign > 0 else (ratios < 0.8)
    assert torch.all(g[clipped] == 0)
    torch.testing.assert_close(g[~clipped], (-sign * ratios[~clipped]) / 23)


def test_gspo_matches_direct_sequence_formula_in_value_and_gradient():
    g = torch.Generator().manual_seed(3)
    lengths = [4, 2, 3]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    old = torch.randn(3, 4, generator=g, dtype=D)
    # sequence log-ratios spread across the tiny clip range so some sequences clip
    shift = torch.tensor([[1e-4, 5e-4, -3e-4, 2e-4], [-6e-4, -4e-4, 0, 0], [1e-4, 0.0, 2e-4, 0]], dtype=D)
    logp = (old + shift).requires_grad_(True)
    seq_adv = torch.tensor([1.0, -2.0, 0.5], dtype=D)
    adv = seq_adv.unsqueeze(-1).expand(3, 4)
    loss, m = compute_policy_loss(
        "gspo", old, logp, adv, mask,
        clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean",
    )
    # direct GSPO: s_i = exp(mean_t(logp - old)), l_i = max(-A s, -A clip(s)), mean over sequences
    logp2 = logp.detach().clone().requires_grad_(True)
    terms = []
    for i, n in enumerate(lengths):
        s = torch.exp((logp2[i, :n] - old[i, :n]).mean())
        a = seq_adv[i]
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - 3e-4, 1 + 4e-4)))
    direct = torch.stack(terms).mean()
    torch.testing.assert_close(loss, direct)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(direct, logp2))
    # seq 0: mean shift 1e-4 (inside); seq 1: -5e-4 with A<0 (clipped low, 2 tokens);
    # seq 2: 1e-4 (inside) -> 2 of 9 tokens clipped
    assert m["pg_clipfrac_low"].item() == pytest.approx(2 / 9)
    assert m["pg_clipfrac_high"].item() == 0.0


def test_gspo_averages_raw_token_log_ratios_then_caps_the_sequence_value():
    # one token's log-ratio (30) is beyond the per-token clamp (20): the sequence mean must use 30
    old = torch.zeros(2, 5, dtype=D)
    logp = torch.tensor(
        [[30.0, 0.0, 0.0, 0.0, float("nan")], [30.0, 30.0, 0.0, 0.0, 0.0]], dtype=D, requires_grad=True
    )
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    adv = torch.full((2, 5), -1.0, dtype=D)  # A < 0: the unclipped side -A s is the loss
    loss, _ = compute_policy_loss(
        "gspo", old, logp, adv, mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4,
        loss_agg_mode="seq-mean-token-mean",
    )
    # seq 0: mean log-ratio 30/4 = 7.5 (< 10, not capped); seq 1: 60/5 = 12 -> capped at 10
    expected = (math.exp(7.5) + math.exp(10.0)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    g = grad_of(loss, logp)
    # d/dlogp_t of s_i / |y_i| / N: s_i / (4 * 2) on seq 0's valid tokens; the capped sequence has
    # no gradient (as verl: the cap is a clamp)
    torch.testing.assert_close(g[0, :4], torch.full((4,), math.exp(7.5) / 8, dtype=D))
    assert g[0, 4].item() == 0.0 and torch.all(g[1] == 0)


def test_cispo_keeps_gradient_on_clipped_tokens():
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1)]], dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=D)
    loss, m = compute_policy_loss(
        "cispo", torch.zeros_like(logp), logp, adv, torch.ones(1, 3),
        **pg_options("cispo", clip_ratio_low=0.2, clip_ratio_high=0.28)
    )
    w = [1.28, 0.8, 1.1]  # clipped importance weights, no gradient through them
    lp = [math.log(1.5), math.log(0.5), math.log(1.1)]
    expected_loss = sum(-a * wi * l for a, wi, l in zip([1, -1, 2], w, lp)) / 3
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    expected = torch.tensor([[-1.28 / 3, 0.8 / 3, -2.2 / 3]], dtype=D)
    torch.testing.assert_close(grad_of(loss, logp), expected, atol=1e-12, rtol=0)
    assert m["pg_clipfrac_high"].item() == pytest.approx(1 / 3)
    assert m["pg_clipfrac_low"].item() == pytest.approx(1 / 3)


def test_gpg_and_reinforce():
    logp = torch.tensor([[-0.5, -1.0], [-2.0, 7.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-0.5, -0.8], [-1.0, 0.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0], [-2.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = compute_policy_loss("gpg", old, logp, adv, mask, **pg_options("gpg", clip_ratio_high=0.3))  # clip ignored
    assert loss.item() == pytest.approx((0.5 + 1.0 - 4.0) / 3)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0]], dtype=D))
    assert m["pg_clipfrac"].item() == 0.0
    assert m["ppo_kl"].item() == pytest.approx((0.0 + 0.2 + 1.0) / 3)

    loss, _ = compute_policy_loss("reinforce", old, logp, adv, mask, **pg_options("reinforce"))
    r = [1.0, math.exp(-0.2), math.exp(-1.0)]
    assert loss.item() == pytest.approx((-r[0] - r[1] + 2 * r[2]) / 3)
    torch.testing.assert_close(
        grad_of(loss, logp), torch.tensor([[-r[0] / 3, -r[1] / 3], [2 * r[2] / 3, 0]], dtype=D)
    )


def test_reinforce_equals_gpg_gradient_on_policy():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(3, 4, generator=g, dtype=D).requires_grad_(True)
    adv = torch.randn(3, 4, generator=g, dtype=D)
    mask = torch.ones(3, 4)
    a, _ = compute_policy_loss("reinforce", logp.detach(), logp, adv, mask, **pg_options("reinforce"))
    b, _ = compute_policy_loss("gpg", logp.detach(), logp, adv, mask, **pg_options("gpg"))
    torch.testing.assert_close(grad_of(a, logp), grad_of(b, logp))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "gpg", "reinforce"])
def test_every_loss_rejects_zero_length_and_shape_mismatch(name):
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"row index\(es\) \[2\]"):
        compute_policy_loss(name, x, x, x, torch.tensor([[1, 0], [1, 1], [0, 0]]), **pg_options(name))
    with pytest.raises(ValueError, match=r"advantages has shape \(3, 1\).*\(3, 2\)"):
        compute_policy_loss(name, x, x, torch.zeros(3, 1), torch.ones(3, 2), **pg_options(name))


def test_bad_clip_ranges_name_the_field():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="actor.clip_ratio_c"):
        compute_policy_loss("vanilla", x, x, x, torch.ones(1, 2), **pg_options("vanilla", clip_ratio_c=0.9))
    with pytest.raises(ValueError, match="actor.clip_ratio_low"):
        compute_policy_loss("vanilla", x, x, x, torch.ones(1, 2), **pg_options("vanilla", clip_ratio_low=1.0))


def test_extreme_log_ratio_stays_finite():
    logp = torch.tensor([[200.0, -200.0]], dtype=torch.float32, requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]])
    loss, m = compute_policy_loss("vanilla", torch.zeros(1, 2), logp, adv, torch.ones(1, 2),
                                  **pg_options("vanilla"))
    assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, logp)).all()
    assert m["pg_clipfrac_dual"].item() == pytest.approx(0.5)


# ---------------------------------------------------------------------- value loss
def test_value_loss_clipping_hand_values():
    vpreds = torch.tensor([[1.0, 0.0, 3.0]], dtype=D, requires_grad=True)
    values = torch.tensor([[0.5, 0.2, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.1, float("nan")]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    loss, m = value_loss(vpreds, values, returns, mask, cliprange_value=0.2, loss_agg_mode=CRITIC.loss_agg_mode)
    # t0: unclipped (1-2)^2 = 1, clipped V = 0.7 -> 1.69 (larger: clipped, no gradient)
    # t1: unclipped 0.01, clipped V = 0.0 -> 0.01 (equal: not counted as clipped)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.01) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    expected = torch.tensor([[0.0, 0.5 * 2 * (0.0 - 0.1) / 2, 0.0]], dtype=D)
    torch.testing.assert_close(grad_of(loss, vpreds), expected)


def test_value_loss_without_clipping_is_half_mse():
    vpreds = torch.tensor([[1.0, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.5]], dtype=D)
    loss, m = value_loss(vpreds, torch.zeros(1, 2, dtype=D), returns, torch.ones(1, 2), cliprange_value=None,
                         loss_agg_mode=CRITIC.loss_agg_mode)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.25) / 2)
    assert m["vf_clipfrac"].item() == 0.0
    with pytest.raises(ValueError, match=r"zero-length responses .*\[0\]"):
        value_loss(vpreds, vpreds, vpreds, torch.zeros(1, 2), CRITIC.cliprange_value, CRITIC.loss_agg_mode)
