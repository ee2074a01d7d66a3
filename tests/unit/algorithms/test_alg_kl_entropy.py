"""KL estimators, reward penalty, loss term, controllers; entropy full-vocab and vocab-sharded."""
import math
import threading

import pytest
import torch

from verl_hpc.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    entropy_from_logits,
    entropy_from_stats,
    kl_estimate,
    kl_loss,
    local_exp_stats,
    local_logit_max,
    make_kl_controller,
    process_group_all_reduce,
)
from alg_options import ACTOR, KL_CTRL


D = torch.float64
LOGP = torch.tensor([[-1.0, -2.0]], dtype=D)
REF = torch.tensor([[-1.5, -1.0]], dtype=D)
ONES = torch.ones(1, 2)
K3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]


@pytest.mark.parametrize(
    "names, expected",
    [
        (("k1", "kl"), [0.5, -1.0]),
        (("abs",), [0.5, 1.0]),
        (("k2", "mse"), [0.125, 0.5]),
        (("k3", "low_var_kl"), K3),
    ],
)
def test_kl_estimators_hand_values_under_both_names(names, expected):
    for name in names:
        got = kl_estimate(LOGP, REF, ONES, name)
        torch.testing.assert_close(got, torch.tensor([expected], dtype=D), atol=1e-12, rtol=0)


def test_k3_is_clamped_both_ways_and_finite():
    logp = torch.tensor([[0.0, 30.0, -0.1]], dtype=D)
    ref = torch.tensor([[30.0, 0.0, -0.1]], dtype=D)
    got = kl_estimate(logp, ref, torch.ones(1, 3), "k3")
    torch.testing.assert_close(got, torch.tensor([[10.0, 10.0, 0.0]], dtype=D))


def test_kl_estimate_zero_on_padding_and_rejects_bad_input():
    logp = torch.tensor([[-1.0, float("nan")]], dtype=D)
    got = kl_estimate(logp, REF, torch.tensor([[1, 0]]), "k2")
    torch.testing.assert_close(got, torch.tensor([[0.125, 0.0]], dtype=D))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*low_var_kl"):
        kl_estimate(LOGP, REF, ONES, "k4")
    with pytest.raises(ValueError, match=r"ref_log_prob has shape \(1, 3\)"):
        kl_estimate(LOGP, torch.zeros(1, 3), ONES, "k1")
    with pytest.raises(ValueError, match=r"row index\(es\) \[0\]"):
        kl_estimate(LOGP, REF, torch.zeros(1, 2), "k1")


def test_apply_kl_penalty_hand_values():
    scores = torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=D)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 9.0]], dtype=D)
    ref = torch.tensor([[-1.5, -1.0], [-1.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards, m = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kl_penalty="kl")
    # k1 = [[0.5, -1.0], [0.5, pad]]
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 1.1], [1.95, 0.0]], dtype=D))
    # per-sequence mean KL: [-0.25, 0.5] -> batch mean 0.125
    assert m["kl"].item() == pytest.approx(0.125) and m["kl_coef"].item() == pytest.approx(0.1)


def test_kl_loss_value_coefficient_and_gradient():
    logp = LOGP.clone().requires_grad_(True)
    loss, m = kl_loss(logp, REF, ONES, kl_loss_coef=0.04, kl_loss_type="low_var_kl",
                      loss_agg_mode=ACTOR.loss_agg_mode)
    assert m["kl_loss"].item() == pytest.approx(sum(K3) / 2)
    assert loss.item() == pytest.approx(0.04 * sum(K3) / 2)
    # d/dlogp of exp(ref - logp) - (ref - logp) - 1 = 1 - exp(ref - logp)
    (g,) = torch.autograd.grad(loss, logp)
    expected = [0.04 * (1 - math.exp(-0.5)) / 2, 0.04 * (1 - math.exp(1.0)) / 2]
    torch.testing.assert_close(g, torch.tensor([expected], dtype=D))


def test_kl_controllers():
    fixed = make_kl_controller("fixed", kl_coef=0.02, target_kl=KL_CTRL.target_kl, horizon=KL_CTRL.horizon)
    fixed.update(current_kl=5.0, n_steps=100)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.02
    ada = make_kl_controller("adaptive", kl_coef=0.1, target_kl=1.0, horizon=100)
    assert isinstance(ada, AdaptiveKLController)
    ada.update(current_kl=1.5, n_steps=10)  # error clipped to +0.2 -> x1.02
    assert ada.value == pytest.approx(0.102)
    ada.update(current_kl=0.9, n_steps=10)  # error -0.1 -> x0.99
    assert ada.value == pytest.approx(0.102 * 0.99)
    ada.update(current_kl=0.0, n_steps=50)  # error clipped to -0.2 -> x0.9
    assert ada.value == pytest.approx(0.102 * 0.99 * 0.9)
    resumed = make_kl_controller("adaptive", kl_coef=0.1, target_kl=1.0, horizon=100)
    resumed.load_state_dict(ada.state_dict())
    assert resumed.value == ada.value
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type.*fixed, adaptive"):
        make_kl_controller("pid", KL_CTRL.kl_coef, KL_CTRL.target_kl, KL_CTRL.horizon)
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.target_kl"):
        make_kl_controller("adaptive", kl_coef=KL_CTRL.kl_coef, target_kl=0.0, horizon=KL_CTRL.horizon)


# ---------------------------------------------------------------------- entropy
def _entropy_ref(logits):
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_hand_values_and_large_logits():
    logits = torch.tensor([[0.0, math.log(3.0)], [5.0, 5.0]], dtype=torch.float32)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([h, math.log(2.0)]))
    shifted = entropy_from_logits(logits + 1e4)  # float32 logits near 1e4 keep ~1e-3 resolution
    torch.testing.assert_close(shifted, torch.tensor([h, math.log(2.0)]), atol=1e-3, rtol=0)
    uniform = torch.zeros(3, 7)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((3,), math.log(7.0)))


def test_entropy_with_minus_inf_vocab_entries_is_finite():
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")]], dtype=D, requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    (g,) = torch.autograd.grad(h.sum(), logits)
    assert torch.isfinite(g).all() and g[0, 2] == 0


def test_entropy_gradient_matches_autograd_reference():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 3, 11, generator=g, dtype=D)).requires_grad_(True)
    weights = torch.randn(2, 3, generator=g, dtype=D)
    (ours,) = torch.autograd.grad((entropy_from_logits(logits) * weights).sum(), logits)
    (ref,) = torch.autograd.grad((_entropy_ref(logits) * weights).sum(), logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(entropy_from_logits(logits), _entropy_ref(logits))
    assert entropy_from_logits(logits.float()).dtype == torch.float32
    low = entropy_from_logits(logits.detach().bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), _entropy_ref(logits.detach().bfloat16()), atol=2e-2, rtol=0)


CHUNKS = [3, 4, 1, 5]  # uneven vocab shards, V = 13


def test_sharded_pieces_equal_full_vocab_entropy():
    g = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(2, 5, sum(CHUNKS), generator=g, dtype=D)
    shards = torch.split(logits, CHUNKS, dim=-1)
    global_max = torch.stack([local_logit_max(s) for s in shards]).amax(0)  # "all-reduce max"
    stats = sum(local_exp_stats(s, global_max) for s in shards)  # "all-reduce sum"
    torch.testing.assert_close(entropy_from_stats(stats).double(), _entropy_ref(logits))


class ThreadGroup:
    """In-process stand-in for a tensor-parallel group: one thread per shard, all_reduce via barrier."""

    def __init__(self, world):
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world
        self.calls = []

    def all_reduce_for(self, rank):
        def all_reduce(t, op):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            if rank == 0:
                self.calls.append(op)
            self.barrier.wait()  # nobody overwrites a slot before everyone has read it
            return out

        return all_reduce


def test_sharded_entropy_with_all_reduce_callable_value_and_gradient():
    g = torch.Generator().manual_seed(2)
    logits = 4 * torch.randn(3, 4, sum(CHUNKS), generator=g, dtype=D)
    weights = torch.randn(3, 4, generator=g, dtype=D)
    full = logits.clone().requires_grad_(True)
    (g_full,) = torch.autograd.grad((_entropy_ref(full) * weights).sum(), full)

    group = ThreadGroup(len(CHUNKS))
    shards = [s.clone().requires_grad_(True) for s in torch.split(logits, CHUNKS, dim=-1)]
    results, errors = [None] * len(shards), []

    def rank_main(rank):
        try:
            h = entropy_from_logits(shards[rank], all_reduce=group.all_reduce_for(rank))
            (grad,) = torch.autograd.grad((h * weights).sum(), shards[rank])  # backward: no communication
            results[rank] = (h.detach(), grad)
        except Exception as e:  # surfaced below; a hung barrier would otherwise hide it
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert group.calls == ["max", "sum"]
    for h, _ in results:
        torch.testing.assert_close(h, _entropy_ref(logits))
    torch.testing.assert_close(torch.cat([gr for _, gr in results], dim=-1), g_full)


def test_process_group_all_reduce_with_gloo_single_rank():
    import torch.distributed as dist

    owned = not dist.is_initialized()  # another test may have left a (single-rank) group behind
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        logits = torch.randn(2, 6, dtype=D)
        h = entropy_from_logits(logits, all_reduce=process_group_all_reduce())
        torch.testing.assert_close(h, _entropy_ref(logits))
        with pytest.raises(ValueError, match="op must be one of"):
            process_group_all_reduce()(torch.zeros(1), "mean")
    finally:
        if owned:
            dist.destroy_process_group()
