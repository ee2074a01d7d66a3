"""PRIME's pieces against values derived by hand (float64): the implicit token rewards and score,
the PRM's CE and pairwise losses, reward-to-go, the leave-one-out baselines of the prime estimator,
the reward granularity and normalisation, the accuracy filter and the PRM's metrics. Padding
carries garbage (inf / 99) that must never reach a result."""
import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from verl_hpc.algorithms import PrmObjective, compute_advantages
from verl_hpc.algorithms.masked import reward_to_go
from verl_hpc.algorithms.prime import (accuracy_filter, ce_loss, implicit_scores, implicit_token_rewards,
                                       outcome_labels, pairwise_loss, pairwise_partners, prm_metrics,
                                       process_rewards, token_reward_stats)
from verl_hpc.trainer.stages.advantage import AdvantageStage

F64 = torch.float64
# two responses to one prompt: A has 2 tokens, B has 3
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)


def sp(x):  # softplus, by hand
    return math.log1p(math.exp(x))


def close(t, rows, rel=1e-12):
    return torch.allclose(t, torch.tensor(rows, dtype=F64), rtol=rel, atol=1e-15)


def test_implicit_token_rewards_and_score():
    prm = torch.tensor([[-1.0, -2.0, float("inf")], [-0.5, -0.25, -3.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -float("inf")], [-0.5, -1.25, -2.0]], dtype=F64)
    r = implicit_token_rewards(prm, ref, MASK, beta=0.1)
    assert close(r, [[0.05, -0.1, 0.0], [0.0, 0.1, -0.1]])
    assert implicit_scores(r, MASK).tolist() == pytest.approx([-0.05, 0.0], abs=1e-15)


def test_ce_loss_is_the_cross_entropy_of_the_sigmoid():
    s = torch.tensor([0.7, -1.2, 0.0], dtype=F64)
    y = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    assert ce_loss(s, y).tolist() == pytest.approx([sp(-0.7), sp(1.2), math.log(2)], rel=1e-12)


def test_pairwise_partners_and_loss():
    # group 0: one right (1.0), two wrong (0.2, -0.5); group 1: both right
    s = torch.tensor([1.0, 0.2, -0.5, 0.3, -0.4], dtype=F64)
    y = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=F64)
    g = torch.tensor([0, 0, 0, 1, 1])
    partners = pairwise_partners(s, y, g)
    assert partners.tolist() == pytest.approx([-0.15, 1.0, 1.0, 0.0, 0.0], abs=1e-15)
    loss = pairwise_loss(s, y, partners)
    want = [sp(-(1.0 + 0.15)), sp(-(1.0 - 0.2)), sp(-(1.0 + 0.5)), sp(-0.3), sp(0.4)]
    assert loss.tolist() == pytest.approx(want, rel=1e-12)


def test_reward_to_go_discounts_and_skips_padding():
    r = torch.tensor([[0.0, 3.4, 99.0], [-0.8, -0.2, -2.6]], dtype=F64)
    assert close(reward_to_go(r, MASK, 1.0), [[3.4, 3.4, 0.0], [-3.6, -2.8, -2.6]])
    assert close(reward_to_go(r, MASK, 0.5), [[1.7, 3.4, 0.0], [-1.55, -1.5, -2.6]])


def _whiten(values):
    mean, std = statistics.fmean(values), statistics.stdev(values)  # unbiased, as the estimator
    return [(v - mean) / math.sqrt(std ** 2 + 1e-8) for v in values]


@pytest.mark.parametrize("gamma, returns", [
    # by hand: mean token rewards A 0.2, B 0.1 -> process baselines A 0.1, B 0.2 -> baselined
    # A [0, 0.2], B [-0.4, -0.1, 0.2]; outcomes 1, 0 -> baselines 0, 1 -> A +1, B -1 on the last
    # token; R = 2 * process + 3 * outcome: A [0, 3.4], B [-0.8, -0.2, -2.6]; then reward-to-go
    (1.0, [[3.4, 3.4], [-3.6, -2.8, -2.6]]),
    (0.5, [[1.7, 3.4], [-1.55, -1.5, -2.6]]),
])
def test_prime_estimator_by_hand(gamma, returns):
    process = torch.tensor([[0.1, 0.3, 99.0], [-0.2, 0.1, 0.4]], dtype=F64)
    outcome = torch.tensor([[0.0, 1.0, 99.0], [0.0, 0.0, 0.0]], dtype=F64)
    adv, ret = compute_advantages("prime", outcome, MASK, group_ids=torch.tensor([7, 7]), process_rewards=process,
                                  gamma=gamma, process_coef=2.0, outcome_coef=3.0, process_loo="others")
    assert ret[0, :2].tolist() == pytest.approx(returns[0]) and ret[1].tolist() == pytest.approx(returns[1])
    assert ret[0, 2] == 0 and adv[0, 2] == 0  # padding
    flat = adv[0, :2].tolist() + adv[1].tolist()
    assert flat == pytest.approx(_whiten(returns[0] + returns[1]), rel=1e-9)


def test_prime_estimator_singleton_group_has_no_baseline():
    process = torch.tensor([[0.1, 0.3]], dtype=F64)
    outcome = torch.tensor([[0.0, 1.0]], dtype=F64)
    _, ret = compute_advantages("prime", outcome, torch.ones(1, 2, dtype=F64), group_ids=[0], process_rewards=process,
                                gamma=1.0, process_coef=1.0, outcome_coef=1.0, process_loo="others")
    assert close(ret, [[1.4, 1.3]])


def test_process_rewards_granularity_and_batch_norm():
    r = torch.tensor([[0.1, 0.3, 99.0], [-0.2, 0.1, 0.4]], dtype=F64)
    assert close(process_rewards(r, MASK, "token", "none"), [[0.1, 0.3, 0.0], [-0.2, 0.1, 0.4]])
    assert close(process_rewards(r, MASK, "whole", "none"), [[0.0, 0.4, 0.0], [0.0, 0.0, 0.3]])
    # reward-to-go: A [0.4, 0.3], B [0.3, 0.5, 0.4] -> the largest |.| is 0.5
    normed = process_rewards(r, MASK, "token", "batch_norm")
    assert close(normed, [[0.1 / 0.500001, 0.3 / 0.500001, 0.0], [-0.2 / 0.500001, 0.1 / 0.500001, 0.4 / 0.500001]])
    with pytest.raises(ValueError, match="prm.granularity"):
        process_rewards(r, MASK, "step", "none")


def test_outcome_labels_and_accuracy_filter():
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    assert outcome_labels(scores, 1.0).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert outcome_labels(scores, 0.5).tolist() == [1.0, 0.0, 1.0, 1.0]
    # groups of 4 with 0, 1, 2 and 4 right: shares 0, 0.25, 0.5, 1
    labels = torch.tensor([0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.float32)
    groups = torch.arange(4).repeat_interleave(4)
    keep, counts = accuracy_filter(labels, groups, 0.2, 0.8)
    assert keep.tolist() == [False] * 4 + [True] * 8 + [False] * 4
    assert counts == {"acc_kept_groups": 2, "acc_dropped_groups": 2}
    keep, _ = accuracy_filter(labels, groups, 0.25, 0.5)  # the band's ends are inside it
    assert keep.tolist() == [False] * 4 + [True] * 8 + [False] * 4


def test_prm_metrics_by_hand():
    s = torch.tensor([2.0, -1.0, 0.5, 0.5], dtype=F64)
    y = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    m = prm_metrics(s, y, [0, 0, 1, 1])
    # predicted right where score > 0: T F T T against T F F T -> 3 of 4; AUC: pairs (pos, neg)
    # (2,-1) (2,.5) (.5,-1) win, (.5,.5) ties -> 3.5 / 4; within groups only (2,-1) and (.5,.5): 1.5 / 2
    assert m == pytest.approx({"acc": 0.75, "auc": 0.875, "group_auc": 0.75, "label_mean": 0.5})
    m = prm_metrics(s, y, [0, 1, 1, 0])  # groups {2, 0.5 right} and {-1, 0.5 wrong}: no pair within a group
    assert "group_auc" not in m and m["auc"] == 0.875
    assert "auc" not in prm_metrics(s, torch.ones(4, dtype=F64), [0, 0, 1, 1])  # one label only: no AUC


def test_token_reward_stats_over_valid_tokens():
    r = torch.tensor([[0.1, 0.3, 99.0], [-0.2, 0.1, 0.4]], dtype=F64)
    m = token_reward_stats(r, MASK)
    vals = [0.1, 0.3, -0.2, 0.1, 0.4]
    assert m == pytest.approx({"token_reward_mean": statistics.fmean(vals), "token_reward_std": statistics.stdev(vals)})


def _counts(mask):
    return SimpleNamespace(tokens=float(mask.sum()), seqs=float(mask.shape[0]), norm_len=float(mask.shape[1]),
                           run_tokens=None, agg_kwargs=lambda: {})


@pytest.mark.parametrize("kind", ["ce", "pairwise"])
def test_prm_objective_split_into_micro_batches_sums_to_the_batch_loss(kind):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=F64)
    lp = (-torch.rand(4, 3, dtype=F64)).requires_grad_()
    ref = -torch.rand(4, 3, dtype=F64)
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    partners = torch.tensor([0.3, -0.2, -0.2, 0.1], dtype=F64)
    obj = PrmObjective(beta=0.5, loss=kind)
    mb = lambda rows: {"response_mask": mask[rows], "ref_log_probs": ref[rows], "outcome_labels": labels[rows],  # noqa: E731
                       "prm_partners": partners[rows]}
    whole, _ = obj({"log_probs": lp}, mb([0, 1, 2, 3]), _counts(mask))
    parts = sum(obj({"log_probs": lp[rows]}, mb(rows), _counts(mask))[0] for rows in ([0, 1], [2], [3]))
    # by hand: score = 0.5 * masked row sum of (lp - ref); the loss is the batch mean
    score = [0.5 * float(((lp.detach() - ref) * mask)[i].sum()) for i in range(4)]
    if kind == "ce":
        want = [sp(-s) if y else sp(s) for s, y in zip(score, labels.tolist())]
    else:
        want = [sp(-(s - p)) if y else sp(s - p) for s, y, p in zip(score, labels.tolist(), partners.tolist())]
    assert float(whole.detach()) == pytest.approx(sum(want) / 4, rel=1e-12)
    assert float(parts.detach()) == pytest.approx(float(whole.detach()), rel=1e-12)
    # the gradient of the summed contributions is the whole batch's
    g1, = torch.autograd.grad(whole, lp)
    g2, = torch.autograd.grad(parts, lp)
    assert torch.allclose(g1, g2, rtol=1e-12) and g1[0, 2] == 0 and g1[2, 1:].abs().sum() == 0


def test_advantage_stage_adds_process_rewards_for_other_estimators():
    algo = SimpleNamespace(adv_estimator="grpo", use_kl_in_reward=False, gamma=1.0, lam=1.0, norm_adv_by_std=False)
    prm = SimpleNamespace(process_coef=2.0, outcome_coef=3.0)
    batch = SimpleNamespace(token_scores=torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64),
                            process_rewards=torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.1, 0.4]], dtype=F64),
                            response_mask=MASK, group_ids=torch.tensor([0, 0]), values=None, baselines=None)
    AdvantageStage(algo, kl_ctrl=None, prm_cfg=prm)(batch)
    # sequence scores: A 3 * 1 + 2 * 0.4 = 3.8, B 2 * 0.3 = 0.6; Dr.GRPO: minus the group mean 2.2
    assert batch.advantages[0, :2].tolist() == pytest.approx([1.6, 1.6])
    assert batch.advantages[1].tolist() == pytest.approx([-1.6, -1.6, -1.6])


# ----------------------------------------------------------------------------- conventions (docs/prime.md)
# One group of 3 (A 2 tokens, B 3, C 1; padding 99): row means A 0.2, B 0.1, C 0.6 (sum 0.9).
LOO_MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=F64)
LOO_R = torch.tensor([[0.3, 0.1, 99.0], [-0.3, 0.0, 0.6], [0.6, 99.0, 99.0]], dtype=F64)
# others (default): r_t - mean of the other rows' means; baselines A 0.35, B 0.4, C 0.15
LOO_OTHERS = [[-0.05, -0.25], [-0.7, -0.4, 0.2], [0.45]]
# verl: 3/2 r_t - 0.9/2 = others + (r_t - row mean) / 2
LOO_VERL = [[0.0, -0.3], [-0.9, -0.45, 0.45], [0.45]]


def _rows(t):
    return [t[0, :2].tolist(), t[1].tolist(), t[2, :1].tolist()]


def _to_go(rows):  # undiscounted reward-to-go, by hand
    return [[sum(r[i:]) for i in range(len(r))] for r in rows]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("loo, want", [("others", LOO_OTHERS), ("verl", LOO_VERL)])
def test_process_leave_one_out_others_and_verl(loo, want, dtype, tol):
    outcome = torch.zeros(3, 3, dtype=dtype)
    adv, ret = compute_advantages("prime", outcome, LOO_MASK.to(dtype), group_ids=[0, 0, 0],
                                  process_rewards=LOO_R.to(dtype), gamma=1.0, process_coef=1.0, outcome_coef=0.0,
                                  process_loo=loo)
    for got, hand in zip(_rows(ret), _to_go(want)):
        assert got == pytest.approx(hand, abs=tol)
    assert ret[0, 2] == 0 and ret[2, 1:].abs().sum() == 0 and adv[2, 1:].abs().sum() == 0  # padding
    flat = sum(_rows(adv), [])
    assert flat == pytest.approx(_whiten(sum(_to_go(want), [])), rel=1e-9 if dtype == F64 else 1e-5)


def test_process_leave_one_out_variants_agree_on_first_token_returns_and_outcomes():
    """verl's extra term sums to 0 over a row: with gamma 1 the first token's return is the same;
    and the outcome, one token per row, gets the same baseline under both."""
    kw = dict(group_ids=[0, 0, 0], process_rewards=LOO_R, gamma=1.0, process_coef=1.0, outcome_coef=0.0)
    _, a = compute_advantages("prime", torch.zeros(3, 3, dtype=F64), LOO_MASK, process_loo="others", **kw)
    _, b = compute_advantages("prime", torch.zeros(3, 3, dtype=F64), LOO_MASK, process_loo="verl", **kw)
    assert torch.allclose(a[:, 0], b[:, 0], atol=1e-15) and not torch.allclose(a[1, 1], b[1, 1])
    outcome = torch.tensor([[0.0, 1.0, 99.0], [0.0, 0.0, 0.0], [1.0, 99.0, 99.0]], dtype=F64)
    kw.update(process_coef=0.0, outcome_coef=1.0)
    _, a = compute_advantages("prime", outcome, LOO_MASK, process_loo="others", **kw)
    _, b = compute_advantages("prime", outcome, LOO_MASK, process_loo="verl", **kw)
    # outcomes 1, 0, 1 -> baselines 0.5, 1, 0.5 -> +0.5, -1, +0.5 on the last token, back to every token
    assert close(a, [[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0], [0.5, 0.0, 0.0]]) and torch.equal(a, b)


def test_process_leave_one_out_verl_in_a_group_of_one_and_bad_name():
    # verl's formula divides by n - 1 = 0 here; the option keeps r_t with no baseline, like others
    _, ret = compute_advantages("prime", torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64), group_ids=[0],
                                process_rewards=torch.tensor([[0.1, 0.3]], dtype=F64), gamma=1.0, process_coef=1.0,
                                outcome_coef=0.0, process_loo="verl")
    assert close(ret, [[0.4, 0.3]])
    with pytest.raises(ValueError, match="prm.process_loo"):
        compute_advantages("prime", torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64), group_ids=[0],
                           process_rewards=torch.zeros(1, 2, dtype=F64), gamma=1.0, process_coef=1.0,
                           outcome_coef=0.0, process_loo="row")


def test_advantage_stage_passes_prm_process_loo():
    algo = SimpleNamespace(adv_estimator="prime", use_kl_in_reward=False, gamma=1.0, lam=1.0, norm_adv_by_std=False)
    for loo, want in (("others", LOO_OTHERS), ("verl", LOO_VERL)):
        prm = SimpleNamespace(process_coef=1.0, outcome_coef=0.0, process_loo=loo)
        batch = SimpleNamespace(token_scores=torch.zeros(3, 3, dtype=F64), process_rewards=LOO_R,
                                response_mask=LOO_MASK, group_ids=torch.tensor([0, 0, 0]), values=None, baselines=None)
        AdvantageStage(algo, kl_ctrl=None, prm_cfg=prm)(batch)
        assert sum(_rows(batch.returns), []) == pytest.approx(sum(_to_go(want), []), abs=1e-12)


def test_group_auc_pools_pairs_and_skips_single_label_prompts():
    # prompt 0: right 1.0 against wrong 0.0, 2.0, 3.0 -> 1 of 3 pairs; prompt 1: right 0.5 over wrong
    # -0.5 -> 1 of 1; prompt 2: both right, no pair. Pooled: 2 / 4 = 0.5 (a per-prompt mean scoring
    # prompt 2 as 0.5, verl's, would give (1/3 + 1 + 0.5) / 3 = 0.6111)
    s = torch.tensor([1.0, 0.0, 2.0, 3.0, 0.5, -0.5, 0.1, 0.2], dtype=F64)
    y = torch.tensor([1, 0, 0, 0, 1, 0, 1, 1], dtype=F64)
    assert prm_metrics(s, y, [0, 0, 0, 0, 1, 1, 2, 2])["group_auc"] == 0.5


def test_acc_counts_a_zero_score_as_predicting_wrong():
    # score 0 reads as "wrong" (sigmoid 0.5 is not > 0.5): right for the label-0 row, wrong for the
    # label-1 row; with the two rows of nonzero score right: 3 of 4 (verl's sign test: 2 of 4)
    s = torch.tensor([0.0, 0.0, 1.0, -1.0], dtype=F64)
    y = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=F64)
    assert prm_metrics(s, y, [0, 0, 1, 1])["acc"] == 0.75


def test_tied_scores_count_half_whatever_the_order():
    # a tie between a right and a wrong response is half a win in auc and group_auc, whichever comes
    # first in the batch (verl's per-prompt accuracy scores it by the order)
    s = torch.tensor([0.5, 0.5], dtype=F64)
    for y in ([1.0, 0.0], [0.0, 1.0]):
        m = prm_metrics(s, torch.tensor(y, dtype=F64), [0, 0])
        assert m["auc"] == 0.5 and m["group_auc"] == 0.5
