"""DPO / cDPO / IPO / SimPO / ORPO / KTO against float64 loop implementations (math module only),
gradients by autograd against the loops, and micro-batch contributions summing to the batch value."""
import math

import pytest
import torch

from verl_hpc.algorithms.preference import (dpo_loss, ipo_loss, kto_loss, kto_reference_point, orpo_loss,
                                            sequence_logps, simpo_loss)
from alg_options import PREFERENCE as PREF

D = torch.float64


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def pairs(seed=0, n=5):
    g = torch.Generator().manual_seed(seed)
    pc = (-torch.rand(n, generator=g, dtype=D) * 8).requires_grad_(True)
    pr = (-torch.rand(n, generator=g, dtype=D) * 8).requires_grad_(True)
    rc = -torch.rand(n, generator=g, dtype=D) * 8
    rr = -torch.rand(n, generator=g, dtype=D) * 8
    lc = torch.randint(1, 9, (n,), generator=g).to(D)
    lr = torch.randint(1, 9, (n,), generator=g).to(D)
    return pc, pr, rc, rr, lc, lr


def check_grads(loss, ref_fn, pc, pr):
    g = torch.autograd.grad(loss, (pc, pr))
    pc2, pr2 = pc.detach().clone().requires_grad_(True), pr.detach().clone().requires_grad_(True)
    total = ref_fn(pc2, pr2)
    g2 = torch.autograd.grad(total, (pc2, pr2))
    for a, b in zip(g, g2):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_dpo_and_cdpo_match_loop(eps):
    pc, pr, rc, rr, _, _ = pairs(1)
    beta = 0.3
    loss, m = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    ref = 0.0
    for i in range(5):
        z = beta * ((pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()))
        ref += -(1 - eps) * logsig(z) - eps * logsig(-z)
    assert loss.item() == pytest.approx(ref / 5, rel=1e-12)
    cr = [beta * (pc[i].item() - rc[i].item()) for i in range(5)]
    rj = [beta * (pr[i].item() - rr[i].item()) for i in range(5)]
    assert m["rewards/chosen"].item() == pytest.approx(sum(cr) / 5)
    assert m["rewards/margins"].item() == pytest.approx((sum(cr) - sum(rj)) / 5)
    assert m["rewards/accuracies"].item() == pytest.approx(sum(c > r for c, r in zip(cr, rj)) / 5)
    assert m["logps/chosen"].item() == pytest.approx(pc.detach().mean().item())

    def torch_ref(a, b):  # the same formula with autograd, from the textbook sigmoid
        z = beta * ((a - rc) - (b - rr))
        return (-(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))).mean()
    check_grads(loss, torch_ref, pc, pr)


def test_dpo_micro_batches_sum_to_full_batch():
    pc, pr, rc, rr, _, _ = pairs(2, n=6)
    full, _ = dpo_loss(pc, pr, rc, rr, PREF.beta, PREF.label_smoothing)
    parts = [dpo_loss(pc[s], pr[s], rc[s], rr[s], PREF.beta, PREF.label_smoothing, global_pairs=6)[0]
             for s in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close(sum(parts), full)


def test_ipo_matches_loop():
    pc, pr, rc, rr, _, _ = pairs(3)
    beta = 0.5
    loss, _ = ipo_loss(pc, pr, rc, rr, beta=beta)
    ref = sum(((pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()) - 1 / (2 * beta)) ** 2
              for i in range(5)) / 5
    assert loss.item() == pytest.approx(ref, rel=1e-12)
    check_grads(loss, lambda a, b: (((a - rc) - (b - rr) - 1 / (2 * beta)) ** 2).mean(), pc, pr)


def test_simpo_length_normalised_matches_loop():
    pc, pr, _, _, lc, lr = pairs(4)
    beta, gamma = 2.0, 0.7
    loss, m = simpo_loss(pc, pr, lc, lr, beta=beta, gamma=gamma, label_smoothing=PREF.label_smoothing)
    ref = sum(-logsig(beta * pc[i].item() / lc[i].item() - beta * pr[i].item() / lr[i].item() - gamma)
              for i in range(5)) / 5
    assert loss.item() == pytest.approx(ref, rel=1e-12)
    assert m["rewards/chosen"].item() == pytest.approx(sum(beta * pc[i].item() / lc[i].item() for i in range(5)) / 5)
    check_grads(loss, lambda a, b: -torch.log(torch.sigmoid(beta * a / lc - beta * b / lr - gamma)).mean(), pc, pr)
    with pytest.raises(ValueError, match=r"rows \[1\] have no token"):
        simpo_loss(pc, pr, lc, torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0], dtype=D), PREF.beta, PREF.gamma,
                   PREF.label_smoothing)


def test_orpo_matches_loop():
    pc, pr, _, _, lc, lr = pairs(5)
    beta = 0.25
    loss, m = orpo_loss(pc, pr, lc, lr, beta=beta)
    ref = 0.0
    for i in range(5):
        ac, ar = pc[i].item() / lc[i].item(), pr[i].item() / lr[i].item()
        odds = lambda a: math.log(math.exp(a) / (1 - math.exp(a)))  # noqa: E731
        ref += -ac - beta * logsig(odds(ac) - odds(ar))
    assert loss.item() == pytest.approx(ref / 5, rel=1e-10)

    def torch_ref(a, b):
        pa, pb = torch.exp(a / lc), torch.exp(b / lr)
        lo = torch.log(pa / (1 - pa)) - torch.log(pb / (1 - pb))
        return (-a / lc - beta * torch.log(torch.sigmoid(lo))).mean()
    check_grads(loss, torch_ref, pc, pr)


def test_kto_with_reference_point_matches_loop():
    g = torch.Generator().manual_seed(6)
    lp = (-torch.rand(6, generator=g, dtype=D) * 5).requires_grad_(True)
    ref = -torch.rand(6, generator=g, dtype=D) * 5
    desirable = torch.tensor([True, False, True, True, False, False])
    kl_ref = -torch.rand(6, generator=g, dtype=D) * 5
    kl_lp = kl_ref + torch.randn(6, generator=g, dtype=D) + 0.5  # policy above the reference on average
    beta, wd, wu = 0.4, 1.0, 1.5
    loss, m = kto_loss(lp, ref, desirable, kl_lp, kl_ref, beta=beta, desirable_weight=wd, undesirable_weight=wu)
    z0 = max(0.0, sum(kl_lp[i].item() - kl_ref[i].item() for i in range(6)) / 6)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    total = 0.0
    for i in range(6):
        r = lp[i].item() - ref[i].item()
        total += wd * (1 - sig(beta * (r - z0))) if desirable[i] else wu * (1 - sig(beta * (z0 - r)))
    assert loss.item() == pytest.approx(total / 6, rel=1e-12)
    assert m["kl"].item() == pytest.approx(z0)
    assert z0 > 0  # this draw exercises a positive reference point
    # z0 is clamped at 0 and carries no gradient
    assert kto_reference_point(kl_ref, kl_ref + 1).item() == 0.0
    (gr,) = torch.autograd.grad(loss, lp)
    for i in range(6):
        r = lp[i].item() - ref[i].item()
        s = sig(beta * (r - z0)) if desirable[i] else sig(beta * (z0 - r))
        expected = (-wd * beta if desirable[i] else wu * beta) * s * (1 - s) / 6
        assert gr[i].item() == pytest.approx(expected, rel=1e-10)


def test_sequence_logps_ignore_padding_and_bad_inputs_are_named():
    tok = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("inf"), 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s, n = sequence_logps(tok, mask)
    assert s.tolist() == [-3.0, -0.5] and n.tolist() == [2.0, 1.0]
    pc, pr, rc, rr, _, _ = pairs(7)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(pc, pr, rc, rr, beta=0.0, label_smoothing=PREF.label_smoothing)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        dpo_loss(pc, pr, rc, rr, beta=PREF.beta, label_smoothing=0.5)
    with pytest.raises(ValueError, match="1-D of one length"):
        dpo_loss(pc, pr[:3], rc, rr, PREF.beta, PREF.label_smoothing)
