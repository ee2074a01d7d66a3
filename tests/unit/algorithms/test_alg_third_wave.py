"""sapo, dppo_tv, dppo_kl, dro, icepop, m2po, gdpo, optimal_token_baseline and
tir_optimal_token_baseline against float64 loop implementations of their papers' / verl's formulas
written here, on a padded grouped batch (groups of 1, 2 and 5 samples and one whose rewards are all
equal; garbage on padding), in float32 and float64; the losses' micro-batch contributions and
gradients against the whole batch's."""
import math

import pytest
import torch

from verl_hpc.algorithms import compute_advantages, compute_policy_loss, sum_pi_squared_from_logits
from verl_hpc.algorithms.m2po import m2po_keep
from alg_options import ACTOR, pg_options

D = torch.float64
GROUPS = [0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3]  # a group of 1, of 2, of 5, and (3) one whose rewards are equal
SCORES = [0.7, 1.0, 0.0, 0.2, 1.0, 0.5, 0.0, 1.0, 0.5, 0.5, 0.5]
LENGTHS = [3, 5, 1, 7, 4, 6, 2, 7, 5, 3, 6]
B, T = len(LENGTHS), 7
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
SPLITS = [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10]]  # micro-batches of whole rows


def positions():
    return [(i, t) for i in range(B) for t in range(LENGTHS[i])]


def grpo_loop(scores, eps=1e-6):
    """GRPO's sequence advantage, written out: (s - mean) / (std + eps), unbiased std; a group of one
    takes mean 0 and std 1 (verl's convention)."""
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(B) if GROUPS[j] == GROUPS[i]]
        if len(members) == 1:
            out.append(s / (1 + eps))
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((s - mean) / (std + eps))
    return out


def batch(seed=0, per_token=False):
    """old, new (leaf, grad), rollout log-probs and advantages [B, T] in float64, mask; padding garbage."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS], dtype=D)
    old = -0.1 - torch.rand(B, T, generator=g, dtype=D) * 2.5
    new = (old + 0.5 * torch.randn(B, T, generator=g, dtype=D)).clamp(max=-0.02)  # log-probs: p < 1
    rollout = (old + 0.25 * torch.randn(B, T, generator=g, dtype=D)).clamp(max=-0.02)
    rollout[::3, 0] -= 1.5  # a few tokens the rollout engine got far off (IcePop's band, M2PO's tail)
    rollout[1::4, 1] += 1.2
    adv = torch.tensor(grpo_loop(SCORES), dtype=D).unsqueeze(-1).expand(B, T).clone()
    if per_token:
        adv = adv + 0.3 * torch.randn(B, T, generator=g, dtype=D)
        adv[8:] = 0.0  # the all-equal group keeps zero advantages
    pad = mask == 0
    old[pad], new[pad], rollout[pad], adv[pad] = float("inf"), float("nan"), float("-inf"), float("nan")
    return old, new.requires_grad_(True), rollout, adv, mask


def agg_loop(terms, mode):
    """Aggregation of {(i, t): token loss}, written out per mode (docs/algorithms.md's table)."""
    per_seq = [sum(terms[(i, t)] for t in range(LENGTHS[i])) for i in range(B)]
    if mode == "token-mean":
        return sum(per_seq) / len(terms)
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(per_seq, LENGTHS)) / B
    if mode == "seq-mean-token-sum":
        return sum(per_seq) / B
    return sum(per_seq) / T / B  # seq-mean-token-sum-norm with norm_len = T


def sigmoid(x):
    return 1 / (1 + torch.exp(-x))


# ------------------------------------------------------------------- the papers' token losses
def sapo_term(o, n, a, ro, keep):
    tau = ACTOR.tau_pos if a > 0 else ACTOR.tau_neg
    r = torch.exp(n - o)
    return -sigmoid(tau * (r - 1)) * 4 / tau * a


def dppo_tv_term(o, n, a, ro, keep, low=0.15, high=0.15, c=3.0):
    p, p_old = math.exp(float(n.detach())), math.exp(o)
    inside = (p - p_old <= high) if a > 0 else (p - p_old >= -low)
    w = min(math.exp(float(n.detach()) - o), c) if inside else 0.0
    return -a * w * n


def dppo_kl_term(o, n, a, ro, keep, low=0.05, high=0.05, c=3.0):
    p, p_old = math.exp(float(n.detach())), math.exp(o)
    kl = p_old * (o - float(n.detach())) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    inside = (kl <= high or p <= p_old) if a > 0 else (kl <= low or p >= p_old)
    w = min(math.exp(float(n.detach()) - o), c) if inside else 0.0
    return -a * w * n


def dro_term(o, n, a, ro, keep):
    return -(a * n - 0.5 * ACTOR.dro_beta * (n - o) ** 2)


def icepop_term(o, n, a, ro, keep):
    k = math.exp(o - ro)
    m = k if ACTOR.icepop_low <= k <= ACTOR.icepop_high else 0.0
    r = torch.exp(n - o)
    lo, hi = 1 - ACTOR.clip_ratio_low, 1 + ACTOR.clip_ratio_high
    return m * torch.maximum(-a * r, -a * r.clamp(lo, hi))


def m2po_term(o, n, a, ro, keep):
    return -a * torch.exp(n - o) * keep


def m2po_keep_loop(old, rollout, tau):
    """The M2PO mask written as the paper's loop: drop the largest (log pi_old - log pi_rollout)^2
    while the mean over the kept tokens exceeds tau."""
    m2 = {(i, t): (float(old[i, t]) - float(rollout[i, t])) ** 2 for i, t in positions()}
    kept = sorted(m2, key=lambda p: m2[p])
    while kept and sum(m2[p] for p in kept) / len(kept) > tau:
        kept.pop()
    return {p: 1.0 if p in set(kept) else 0.0 for p in m2}


TERMS = {"sapo": sapo_term, "dppo_tv": dppo_tv_term, "dppo_kl": dppo_kl_term, "dro": dro_term,
         "icepop": icepop_term, "m2po": m2po_term}
# the options the loops above assume (DPPO: the paper's bounds in clip_ratio_low/high, C = 3)
OPTIONS = {"dppo_tv": dict(clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=3.0),
           "dppo_kl": dict(clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=3.0)}


def opts(name, mode):
    """The actor section's options of loss `name`, with OPTIONS' and the aggregation mode on top."""
    return pg_options(name, **OPTIONS.get(name, {}), loss_agg_mode=mode)


def loss_inputs(name, old, rollout, mask):
    """The loss's extra inputs: icepop the rollout's log-probs, m2po the whole batch's mask."""
    if name == "icepop":
        return dict(rollout_log_probs=rollout)
    if name == "m2po":
        return dict(m2po_keep=m2po_keep(old, rollout, mask, ACTOR.m2_threshold)[0])
    return {}


def hand_loss(name, old, new, rollout, adv, mode):
    keep = m2po_keep_loop(old, rollout, ACTOR.m2_threshold)
    terms = {(i, t): TERMS[name](float(old[i, t]), new[i, t], float(adv[i, t]), float(rollout[i, t]), keep[(i, t)])
             for i, t in positions()}
    return agg_loop(terms, mode)


def run(name, old, new, rollout, adv, mask, mode, dtype=D, **counts):
    cast = lambda x: x if x is None else x.to(dtype)  # noqa: E731
    extra = {k: cast(v) for k, v in loss_inputs(name, old, rollout, mask).items()}
    return compute_policy_loss(name, cast(old), new, cast(adv), mask, **opts(name, mode), norm_len=T, **extra, **counts)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(TERMS))
@pytest.mark.parametrize("per_token", [False, True])
def test_loss_equals_its_formula_in_value_and_gradient_float64_and_float32(name, mode, per_token):
    old, new, rollout, adv, mask = batch(1, per_token)
    ref_in = new.detach().clone().requires_grad_(True)
    ref = hand_loss(name, old, ref_in, rollout, adv, mode)
    (ref_grad,) = torch.autograd.grad(ref, ref_in)
    loss, metrics = run(name, old, new, rollout, adv, mask, mode)
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.nan_to_num(ref_grad, nan=0.0), rtol=1e-10, atol=1e-12)
    assert torch.all(grad[mask == 0] == 0)  # padding's garbage reaches nothing
    assert all(torch.isfinite(v) and v.dim() == 0 for v in metrics.values())
    new32 = new.detach().float().requires_grad_(True)
    loss32, _ = run(name, old, new32, rollout, adv, mask, mode, dtype=torch.float32)
    (grad32,) = torch.autograd.grad(loss32, new32)
    assert loss32.dtype == torch.float32
    torch.testing.assert_close(loss32.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad32.double(), torch.nan_to_num(ref_grad, nan=0.0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(TERMS))
def test_micro_batch_contributions_and_gradients_add_up_to_the_whole_batch(name, mode):
    old, new, rollout, adv, mask = batch(2, per_token=True)
    full, _ = run(name, old, new, rollout, adv, mask, mode)
    (g_full,) = torch.autograd.grad(full, new)
    keep = m2po_keep(old, rollout, mask, ACTOR.m2_threshold)[0]  # m2po: made once over the whole batch
    parts = []
    for rows in SPLITS:
        extra = dict(loss_inputs(name, old, rollout, mask))
        if name == "icepop":
            extra["rollout_log_probs"] = rollout[rows]
        if name == "m2po":
            extra["m2po_keep"] = keep[rows]
        part, _ = compute_policy_loss(name, old[rows], new[rows], adv[rows], mask[rows],
                                      **opts(name, mode), norm_len=T,
                                      global_tokens=float(mask.sum()), global_seqs=float(B), **extra)
        parts.append(part)
    (g_parts,) = torch.autograd.grad(sum(parts), new)
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_parts, g_full, rtol=1e-12, atol=1e-14)
    assert torch.count_nonzero(g_full) > 0


def test_the_batch_exercises_every_branch():
    """The comparisons above see both sides of each loss's cases (not vacuous)."""
    old, new, rollout, adv, mask = batch(1)
    valid = mask > 0
    k = torch.exp(old - rollout)[valid]
    assert bool(((k < ACTOR.icepop_low) | (k > ACTOR.icepop_high)).any()) and bool(((k > 0.5) & (k < 5)).any())
    keep = m2po_keep(old, rollout, mask, ACTOR.m2_threshold)[0][valid]
    assert 0 < int((keep == 0).sum()) < keep.numel() // 2  # the tail goes, most tokens stay
    p, p_old = torch.exp(new.detach())[valid], torch.exp(old)[valid]
    assert bool((p - p_old > 0.15).any()) and bool((p_old - p > 0.15).any())  # TV outside, both ways
    a = adv[valid]
    assert bool((a > 0).any()) and bool((a < 0).any()) and bool((a == 0).any())
    for name in ("dppo_tv", "dppo_kl"):
        _, m = run(name, old, new, rollout, adv, mask, "token-mean")
        assert 0 < m["pg_clipfrac"] < 1, name


# ---------------------------------------------------------------------------- particular cases
def test_sapo_is_ppos_gradient_on_policy_and_decays_off_it():
    old, _, _, adv, mask = batch(3)
    on = old.clone().masked_fill(mask == 0, 0.0).requires_grad_(True)
    loss, m = compute_policy_loss("sapo", old, on, adv, mask, **pg_options("sapo", loss_agg_mode="token-sum"))
    (g,) = torch.autograd.grad(loss, on)
    torch.testing.assert_close(g, torch.where(mask > 0, -adv, torch.zeros_like(adv)))  # slope 1 at r = 1
    assert m["sapo_weight_mean"].item() == pytest.approx(1.0)
    far = (old + 3.0).masked_fill(mask == 0, 0.0).requires_grad_(True)
    loss, m = compute_policy_loss("sapo", old, far, adv, mask, **pg_options("sapo", loss_agg_mode="token-sum"))
    assert 0 < m["sapo_weight_mean"].item() < 0.05  # far off-policy: almost no gradient, yet not a hard zero


def test_icepop_with_agreeing_engines_is_ppo_clip_and_keeps_the_mask_per_token():
    old, new, _, adv, mask = batch(4)
    loss, m = compute_policy_loss("icepop", old, new, adv, mask, **pg_options("icepop", loss_agg_mode="token-mean"),
                                  rollout_log_probs=old.clone())
    ppo, _ = compute_policy_loss("vanilla", old, new, adv, mask,
                                 **pg_options("vanilla", clip_ratio_c=None, loss_agg_mode="token-mean"))
    torch.testing.assert_close(loss, ppo)
    assert m["icepop_masked_frac"].item() == 0.0 and m["icepop_weight_mean"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="icepop needs the rollout's log-probs"):
        compute_policy_loss("icepop", old, new, adv, mask, **pg_options("icepop", loss_agg_mode="token-mean"),
                            rollout_log_probs=None)


def test_m2po_mask_is_the_papers_loop_with_its_metrics_and_edges():
    old, _, rollout, _, mask = batch(5)
    for tau in (0.005, ACTOR.m2_threshold, 0.2):
        keep, m = m2po_keep(old, rollout, mask, tau)
        want = m2po_keep_loop(old, rollout, tau)
        assert {p: float(keep[p]) for p in want} == want
        assert torch.all(keep[mask == 0] == 0)
        kept = [(float(old[p]) - float(rollout[p])) ** 2 for p in want if want[p]]
        assert m["m2po/masked_frac"].item() == pytest.approx(1 - len(kept) / len(want))
        assert m["m2po/m2_kept"].item() == pytest.approx(sum(kept) / len(kept), rel=1e-6)
        assert sum(kept) / len(kept) <= tau < m["m2po/m2"].item()  # it had something to mask
    keep, m = m2po_keep(old, old.clone(), mask, ACTOR.m2_threshold)  # engines agree: nothing goes
    assert torch.equal(keep, mask) and m["m2po/masked_frac"].item() == 0.0
    keep, m = m2po_keep(old, old - 1.0, mask, ACTOR.m2_threshold)  # every token 1 > tau: all go
    assert torch.all(keep == 0) and m["m2po/masked_frac"].item() == 1.0
    with pytest.raises(ValueError, match="m2po needs the step's M2PO mask"):
        compute_policy_loss("m2po", old, old.clone().requires_grad_(True), old, mask,
                            **pg_options("m2po", loss_agg_mode="token-mean"), m2po_keep=None)


def test_dro_penalty_reaches_rows_without_advantage():
    """Why dro is not row-local: a moved policy gets a gradient on a zero-advantage row."""
    old, new, _, adv, mask = batch(6)
    loss, _ = compute_policy_loss("dro", old, new, adv, mask, **pg_options("dro", loss_agg_mode="token-mean"))
    (g,) = torch.autograd.grad(loss, new)
    zero_rows = [8, 9, 10]  # the all-equal group
    assert torch.all(adv[zero_rows][mask[zero_rows] > 0] == 0) and torch.count_nonzero(g[zero_rows]) > 0


@pytest.mark.parametrize("name, bad, match", [
    ("sapo", dict(tau_neg=0.0), "tau_pos and actor.tau_neg must be > 0"),
    ("dro", dict(dro_beta=0.0), "dro_beta"),
    ("icepop", dict(icepop_low=5.0), "icepop_low / icepop_high"),
    ("dppo_tv", dict(clip_ratio_high=-0.1), "divergence bounds"),
])
def test_bad_options_are_refused_naming_the_field(name, bad, match):
    old, new, rollout, adv, mask = batch(7)
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(name, old, new, adv, mask, **pg_options(name, **bad, loss_agg_mode="token-mean"),
                            **loss_inputs(name, old, rollout, mask))


# -------------------------------------------------------------------------------------- GDPO
def outcome_rewards(scores, dtype=D):
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS], dtype=dtype)
    r = torch.zeros(B, T, dtype=dtype)
    for i, n in enumerate(LENGTHS):
        r[i, n - 1] = scores[i]
    return r, mask


def whiten_loop(per_seq):
    values = [per_seq[i] for i, t in positions()]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in per_seq]


def centred_loop(scores):
    """s - group mean; a group of one keeps its score (mean 0)."""
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(B) if GROUPS[j] == GROUPS[i]]
        out.append(s - (sum(members) / len(members) if len(members) > 1 else 0.0))
    return out


def gdpo_loop(components, weights, norm):
    total = [0.0] * B
    for k, w in enumerate(weights):
        comp = [c[k] for c in components]
        a = grpo_loop(comp) if norm else centred_loop(comp)
        total = [x + w * y for x, y in zip(total, a)]
    return whiten_loop(total)


FORMAT = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]  # a second component (all-equal group: equal)


@pytest.mark.parametrize("dtype", [D, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("weights", [None, [1.0, 0.5]])
def test_gdpo_equals_its_formula(dtype, norm, weights):
    rewards, mask = outcome_rewards(SCORES, dtype)
    comps = torch.tensor([[s, f] for s, f in zip(SCORES, FORMAT)], dtype=dtype)
    adv, ret = compute_advantages("gdpo", rewards, mask, group_ids=GROUPS, norm_adv_by_std=norm,
                                  reward_components=comps, reward_weights=weights)
    want = gdpo_loop([[s, f] for s, f in zip(SCORES, FORMAT)], weights or [1.0, 1.0], norm)
    tol = 1e-12 if dtype == D else 1e-5
    for i, n in enumerate(LENGTHS):
        assert adv[i, :n].tolist() == pytest.approx([want[i]] * n, abs=tol)
        assert torch.all(adv[i, n:] == 0)
    assert adv.dtype == dtype and torch.equal(adv, ret)
    assert want[8] == want[9] == want[10]  # the all-equal group: one advantage (the whitened 0)
    # without components: the score is the one component (GRPO, then whitened)
    alone, _ = compute_advantages("gdpo", rewards, mask, group_ids=GROUPS, norm_adv_by_std=norm)
    want = gdpo_loop([[s] for s in SCORES], [1.0], norm)
    assert [float(alone[i, 0]) for i in range(B)] == pytest.approx(want, abs=tol)


def test_gdpo_decouples_what_grpo_sums():
    """Two responses whose components differ but whose sums agree: GRPO gives them one advantage,
    GDPO tells them apart (the paper's motivating case)."""
    groups = [0, 0, 0]
    rewards, mask = torch.zeros(3, 1, dtype=D), torch.ones(3, 1, dtype=D)
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=D)  # format vs accuracy, sums 1, 1, 0
    rewards[:, 0] = comps.sum(-1)
    grpo, _ = compute_advantages("grpo", rewards, mask, group_ids=groups, norm_adv_by_std=True)
    assert grpo[0, 0] == grpo[1, 0]
    gdpo, _ = compute_advantages("gdpo", rewards, mask, group_ids=groups, norm_adv_by_std=True,
                                 reward_components=comps, reward_weights=[2.0, 1.0])
    assert gdpo[0, 0] > gdpo[1, 0] > gdpo[2, 0]
    with pytest.raises(ValueError, match="2 reward components"):
        compute_advantages("gdpo", rewards, mask, group_ids=groups, norm_adv_by_std=True, reward_components=comps,
                           reward_weights=[1.0])


# ----------------------------------------------------------------------- optimal token baselines
def otb_inputs(seed, holes, dtype=D):
    """Token rewards (a score on the last token and an intermediate one), pi_old's log-probs, sum pi^2
    (>= p^2, as for a distribution), IS weights; with `holes` some rows have tool-output tokens
    (mask 0) inside the response."""
    g = torch.Generator().manual_seed(seed)
    rewards, mask = outcome_rewards(SCORES, D)
    if holes:
        for i, cut in ((3, [2, 3]), (5, [1]), (7, [4, 5]), (1, [2])):
            mask[i, cut] = 0.0
    rewards[:, 0] += 0.3 * torch.randn(B, generator=g, dtype=D) * mask[:, 0]
    old = -torch.rand(B, T, generator=g, dtype=D) * 3
    p = torch.exp(old)
    spp = p * p + (1 - p) ** 2 * torch.rand(B, T, generator=g, dtype=D)
    rho = 0.5 + torch.rand(B, T, generator=g, dtype=D)
    return [x.to(dtype) for x in (rewards, mask, old, spp, rho)]


def otb_loop(rewards, mask, old, spp, rho, tir):
    """verl's OTB, written out: G the reward-to-go, W the cumulative (1 - 2p + sum p^2) rho^2 over
    positions; per group (>= 2 members) b = sum G W / (sum W + 1e-8) at each position (TIR: at each
    rank among the row's valid tokens), the unique longest row's baseline 0 past the second longest
    (verl's handle_zero_tail, on in both); A = G - b on valid tokens."""
    valid = [[t for t in range(T) if mask[i, t] > 0] for i in range(B)]
    G = [[sum(float(rewards[i, s]) for s in valid[i] if s >= t) for t in range(T)] for i in range(B)]
    W, acc = [], 0.0
    for i in range(B):
        acc, row = 0.0, []
        for t in range(T):
            if mask[i, t] > 0:
                w = 1 - 2 * math.exp(float(old[i, t])) + float(spp[i, t])
                acc += w * (float(rho[i, t]) ** 2 if rho is not None else 1.0)
            row.append(acc)
        W.append(row)
    adv = [[0.0] * T for _ in range(B)]
    for g in set(GROUPS):
        rows = [i for i in range(B) if GROUPS[i] == g]
        for i in rows:
            for k, t in enumerate(valid[i]):
                col = k if tir else t
                if len(rows) == 1:
                    base = 0.0
                else:
                    def at(j):  # row j's (G, W) at the column, or None where it has no token there
                        if tir:
                            return (G[j][valid[j][col]], W[j][valid[j][col]]) if col < len(valid[j]) else None
                        return (G[j][col], W[j][col]) if mask[j, col] > 0 else None
                    pts = [at(j) for j in rows if at(j) is not None]
                    base = sum(gg * ww for gg, ww in pts) / (sum(ww for _, ww in pts) + 1e-8)
                    lens = sorted(len(valid[j]) for j in rows)
                    if len(valid[i]) == lens[-1] > lens[-2] and col >= lens[-2]:
                        base = 0.0
                adv[i][t] = G[i][t] - base
    return adv, G


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("dtype", [D, torch.float32])
def test_optimal_token_baselines_equal_verls_formula(name, holes, with_is, dtype):
    rewards, mask, old, spp, rho = otb_inputs(8, holes, dtype)
    adv, ret = compute_advantages(name, rewards, mask, group_ids=GROUPS, old_log_probs=old, sum_pi_squared=spp,
                                  rollout_is_weights=rho if with_is else None)
    want, G = otb_loop(*(x.double() for x in (rewards, mask, old, spp)), rho.double() if with_is else None,
                       tir=name.startswith("tir"))
    tol = 1e-10 if dtype == D else 2e-5
    torch.testing.assert_close(adv.double(), torch.tensor(want, dtype=D) * mask.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(ret.double(), torch.tensor(G, dtype=D) * mask.double(), rtol=tol, atol=tol)
    assert adv.dtype == dtype
    torch.testing.assert_close(adv[0], ret[0])  # a group of one: no baseline


def test_otb_zero_tail_by_hand():
    """One group, lengths 2 and 4, every w = 1 - 2 pi + sum pi^2 = 1 (pi = 0.25, sum pi^2 = 0.5), so
    W = 1, 2, 3, 4; rewards 1 and 0.5 at the last tokens: G = [1, 1] and [0.5] * 4. b_0 = (1 + 0.5) / 2,
    b_1 = (2 + 1) / 4 = 0.75; past length 2 the long row is alone: b = 0 (verl's default zero tail),
    A = 0.5 - 0 there, not 0.5 - 0.5 * 3 / (3 + 1e-8)."""
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]], dtype=D)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=D)
    common = dict(group_ids=[0, 0], old_log_probs=torch.full((2, 4), math.log(0.25), dtype=D),
                  sum_pi_squared=torch.full((2, 4), 0.5, dtype=D))
    want = torch.tensor([[0.25, 0.25, 0.0, 0.0], [-0.25, -0.25, 0.5, 0.5]], dtype=D)
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        adv, ret = compute_advantages(name, rewards, mask, **common)
        torch.testing.assert_close(adv, want, rtol=0, atol=1e-7)
        torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0, 0], [0.5] * 4], dtype=D))


@pytest.mark.parametrize("loss, options", [("dro", dict(dro_beta=0.1)),
                                           ("gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4))])
def test_dro_and_gspo_ppo_kl_is_the_unclamped_mean_as_in_verl(loss, options):
    """log-ratios 30 and 0: ppo_kl = -(30 + 0) / 2 = -15 (a clamp at 20 would give -10)."""
    from verl_hpc.algorithms import compute_policy_loss

    old = torch.tensor([[-40.0, -1.0]], dtype=D)
    new = old + torch.tensor([[30.0, 0.0]], dtype=D)
    _, metrics = compute_policy_loss(loss, old, new, torch.ones(1, 2, dtype=D), torch.ones(1, 2, dtype=D),
                                     loss_agg_mode="token-mean", **options)
    assert float(metrics["ppo_kl"]) == -15.0


def test_tir_differs_from_otb_where_tool_tokens_shift_the_index():
    def both(holes):
        rewards, mask, old, spp, _ = otb_inputs(9, holes)
        common = dict(group_ids=GROUPS, old_log_probs=old, sum_pi_squared=spp)
        plain, _ = compute_advantages("optimal_token_baseline", rewards, mask, **common)
        tir, _ = compute_advantages("tir_optimal_token_baseline", rewards, mask, **common)
        return {int(i) for i in (plain - tir).abs().gt(1e-12).any(-1).nonzero().flatten()}

    # no holes: ranks are positions, and both zero the unique longest row's tail: the same
    assert both(holes=False) == set()
    # holes in rows 1, 3, 5, 7: group 2's rows without a hole are compared at other tokens too
    differ = both(holes=True)
    assert {4, 6} & differ and differ <= {1, 2, 3, 4, 5, 6, 7, 10}


# ---------------------------------------------------------------- sum_v pi_v^2 from the logits
def test_sum_pi_squared_from_whole_and_vocab_sharded_logits():
    from test_alg_kl_entropy import CHUNKS, ThreadGroup
    import threading

    g = torch.Generator().manual_seed(10)
    logits = 4 * torch.randn(3, 4, sum(CHUNKS), generator=g, dtype=D)
    logits[0, 0, -2:] = float("-inf")  # padded vocabulary entries
    want = (torch.softmax(logits, -1) ** 2).sum(-1)
    torch.testing.assert_close(sum_pi_squared_from_logits(logits), want)
    torch.testing.assert_close(sum_pi_squared_from_logits(logits.float()).double(), want, rtol=1e-5, atol=1e-7)
    group, shards = ThreadGroup(len(CHUNKS)), torch.split(logits, CHUNKS, dim=-1)
    results = [None] * len(shards)
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(
        r, sum_pi_squared_from_logits(shards[r], all_reduce=group.all_reduce_for(r)))) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert group.calls == ["max", "sum"]
    for got in results:
        torch.testing.assert_close(got, want)
