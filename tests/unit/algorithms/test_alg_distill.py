"""On-policy distillation's signal (verl_hpc/algorithms/distill.py) against float64 hand formulas,
written out here loop by loop: the per-token reverse KL, the reward mode's advantages beside GRPO's
group advantages, the loss mode's value and gradient, padding that never counts, and micro-batch
contributions that sum to the whole batch's term in every aggregation mode."""
import math

import pytest
import torch

from alg_options import ACTOR, adv_options
from verl_hpc.algorithms import PolicyObjective, compute_advantages
from verl_hpc.algorithms.distill import distill_advantages, distill_loss, mix_advantages, reverse_kl, teacher_metrics
from verl_hpc.config import JobConfig
from verl_hpc.engines.base import GlobalCounts

LENGTHS = [3, 5, 1, 4, 2, 5]  # response lengths: rows padded to 5
GROUPS = [0, 0, 0, 1, 1, 1]


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    student = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    # padding holds garbage, as a batch may: it must never show
    student[mask == 0], teacher[mask == 0] = 7.0, -50.0
    return student, teacher, mask


def _hand_kl(student, teacher, mask):
    out = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if mask[i, j]:
                out[i][j] = float(student[i, j]) - float(teacher[i, j])
    return torch.tensor(out, dtype=torch.float64)


def test_reverse_kl_and_reward_advantages_equal_the_hand_formula():
    student, teacher, mask = _batch()
    want = _hand_kl(student, teacher, mask)
    assert torch.equal(reverse_kl(student, teacher, mask), want)
    assert torch.allclose(distill_advantages(student, teacher, mask, 0.3), -0.3 * want, rtol=0, atol=1e-15)
    m = teacher_metrics(student, teacher, mask)
    assert math.isclose(m["kl"], float(want.sum()) / sum(LENGTHS), rel_tol=1e-12)
    assert math.isclose(m["log_prob_mean"], float((teacher * mask).sum()) / sum(LENGTHS), rel_tol=1e-12)


def test_reward_mode_adds_the_distillation_advantage_to_grpos_group_advantages():
    student, teacher, mask = _batch(1)
    scores = torch.zeros_like(mask)
    outcome = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
    for i, n in enumerate(LENGTHS):
        scores[i, n - 1] = outcome[i]  # the outcome on the last response token
    task, _ = compute_advantages("grpo", scores, mask, group_ids=torch.tensor(GROUPS), **adv_options())
    got = mix_advantages(task, student, teacher, mask, coef=0.5)
    for i in range(len(LENGTHS)):
        group = [outcome[k] for k in range(len(GROUPS)) if GROUPS[k] == GROUPS[i]]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        a_task = (outcome[i] - mean) / (std + 1e-6)
        for j in range(mask.shape[1]):
            want = a_task - 0.5 * (float(student[i, j]) - float(teacher[i, j])) if j < LENGTHS[i] else 0.0
            assert abs(float(got[i, j]) - want) < 1e-12, (i, j)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
def test_loss_mode_value_and_gradient_equal_the_hand_formula(mode):
    student, teacher, mask = _batch(2)
    logp = student.clone().requires_grad_(True)
    loss, m = distill_loss(logp, teacher, mask, 0.7, mode)
    loss.backward()
    kl, tokens = _hand_kl(student, teacher, mask), sum(LENGTHS)
    b = len(LENGTHS)
    if mode == "token-mean":
        value, weight = float(kl.sum()) / tokens, [[1.0 / tokens] * 5] * b
    elif mode == "token-sum":
        value, weight = float(kl.sum()), [[1.0] * 5] * b
    elif mode == "seq-mean-token-mean":
        value = sum(float(kl[i].sum()) / n for i, n in enumerate(LENGTHS)) / b
        weight = [[1.0 / (n * b)] * 5 for n in LENGTHS]
    else:
        value, weight = sum(float(kl[i].sum()) for i in range(b)) / b, [[1.0 / b] * 5] * b
    assert math.isclose(float(m["teacher_kl_loss"]), value, rel_tol=1e-12)
    assert math.isclose(float(loss.detach()), 0.7 * value, rel_tol=1e-12)
    # the gradient is k2's: coef * weight_t * (log pi - log pi_T), not k1's coef * weight_t
    want = torch.tensor(weight, dtype=torch.float64) * 0.7 * kl
    assert torch.allclose(logp.grad, want, rtol=0, atol=1e-14)
    assert bool((logp.grad[mask == 0] == 0).all())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_contributions_sum_to_the_whole_batch(mode):
    student, teacher, mask = _batch(3)
    counts = dict(global_tokens=float(mask.sum()), global_seqs=float(mask.shape[0]), norm_len=5.0)
    whole, _ = distill_loss(student, teacher, mask, 0.4, mode, **counts)
    parts = sum(float(distill_loss(student[r], teacher[r], mask[r], 0.4, mode, **counts)[0])
                for r in (slice(0, 1), slice(1, 4), slice(4, 6)))
    assert math.isclose(parts, float(whole), rel_tol=1e-12)


def _objective(distill):
    cfg = JobConfig()
    cfg.teacher.enable, cfg.teacher.mode, cfg.teacher.coef = True, "loss", 0.25
    on = PolicyObjective.from_config(ACTOR, cfg.teacher)
    assert on.distill_coef == (0.25)
    cfg.teacher.mode = "reward"  # reward mode: the actor's loss has no teacher term
    assert PolicyObjective.from_config(ACTOR, cfg.teacher).distill_coef == 0.0
    return on if distill else PolicyObjective.from_config(ACTOR)


def test_the_policy_objective_adds_the_term_and_runs_every_row():
    student, teacher, mask = _batch(4)
    old = student + 0.05
    adv = torch.zeros_like(mask)  # all-zero advantages: the policy term is 0, the teacher's is not
    mb = dict(old_log_probs=old, advantages=adv, response_mask=mask, teacher_log_probs=teacher)
    counts = GlobalCounts(tokens=float(mask.sum()), seqs=float(mask.shape[0]), norm_len=5.0)
    plain, with_teacher = _objective(False), _objective(True)
    assert plain.rows_without_gradient(mb) is not None and with_teacher.rows_without_gradient(mb) is None
    base, _ = plain({"log_probs": student}, mb, counts)
    loss, m = with_teacher({"log_probs": student}, mb, counts)
    kl = _hand_kl(student, teacher, mask)
    assert math.isclose(float(loss - base), 0.25 * float(kl.sum()) / float(mask.sum()), rel_tol=1e-10)
    assert math.isclose(float(m["teacher_kl_loss"]), float(kl.sum()) / float(mask.sum()), rel_tol=1e-10)
