"""Advantage estimators against hand-derived values and straightforward float64 loop references."""
import math

import numpy as np
import pytest
import torch

from verl_hpc.algorithms import compute_advantages
from alg_options import adv_options


S3 = math.sqrt(1.0 / 3.0)  # unbiased std of {1, 0, 0}
INV_SQRT2 = 1.0 / math.sqrt(2.0)


def outcome(scores, lengths, length=None):
    """Token-level outcome rewards: each score on its row's last valid token; NaN-free padding."""
    length = length or max(lengths)
    r = torch.zeros(len(scores), length, dtype=torch.float64)
    m = torch.zeros(len(scores), length, dtype=torch.float64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        r[i, n - 1] = s
        m[i, :n] = 1
    return r, m


def close(t, expected, atol=1e-12):
    torch.testing.assert_close(t.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def per_seq(adv, mask):
    """The one value of each row (asserting it is constant over valid tokens and 0 on padding)."""
    out = []
    for a, m in zip(adv, mask):
        valid = a[m > 0]
        assert torch.allclose(valid, valid[0].expand_as(valid))
        assert torch.all(a[m == 0] == 0)
        out.append(float(valid[0]))
    return out


# ---------------------------------------------------------------------- group-relative estimators
# groups: a = {1, 0, 0}, b = {0.5} (singleton), c = {1, 1} (all equal); padding inside the batch.
GROUP_SCORES = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0]
GROUP_LENGTHS = [3, 1, 2, 4, 2, 3]
GROUP_IDS = ["a", "a", "a", "b", "c", "c"]


def test_grpo_hand_values():
    r, m = outcome(GROUP_SCORES, GROUP_LENGTHS)
    adv, ret = compute_advantages("grpo", r, m, group_ids=GROUP_IDS, **adv_options())
    a, b = (2 / 3) / (S3 + 1e-6), (-1 / 3) / (S3 + 1e-6)
    expected = [a, b, b, 0.5 / (1 + 1e-6), 0.0, 0.0]
    assert per_seq(adv, m) == pytest.approx(expected, abs=1e-12)  # singleton: mean 0, std 1
    assert torch.equal(adv, ret)


def test_dr_grpo_no_std_division():
    r, m = outcome(GROUP_SCORES, GROUP_LENGTHS)
    adv, _ = compute_advantages("grpo", r, m, group_ids=GROUP_IDS, **adv_options(norm_adv_by_std=False))
    assert per_seq(adv, m) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.5, 0.0, 0.0], abs=1e-12)


def test_rloo_hand_values():
    r, m = outcome(GROUP_SCORES, GROUP_LENGTHS)
    adv, _ = compute_advantages("rloo", r, m, group_ids=GROUP_IDS, **adv_options())
    assert per_seq(adv, m) == pytest.approx([1.0, -0.5, -0.5, 0.5, 0.0, 0.0], abs=1e-12)


def test_opo_length_weighted_baseline():
    # group {1 (len 2), 0 (len 4)}: b = (2*1 + 4*0) / 6 = 1/3; singleton: baseline 0
    r, m = outcome([1.0, 0.0, 0.7], [2, 4, 3])
    adv, _ = compute_advantages("opo", r, m, group_ids=[0, 0, 1], **adv_options())
    assert per_seq(adv, m) == pytest.approx([2 / 3, -1 / 3, 0.7], abs=1e-12)


def test_gpg_alpha_corrects_for_zero_advantage_groups():
    # a = {1, 0} valid, c = {1, 1} invalid (M = 2), singleton 0.5 valid: B = 5, alpha = 5 / 3
    r, m = outcome([1.0, 0.0, 1.0, 1.0, 0.5], [2, 3, 1, 2, 2])
    adv, _ = compute_advantages("gpg", r, m, group_ids=["a", "a", "c", "c", "s"], **adv_options())
    a = 5 / 3
    assert per_seq(adv, m) == pytest.approx([0.5 * a, -0.5 * a, 0.0, 0.0, 0.5 * a], abs=1e-12)


def test_reinforce_pp_baseline_hand_values():
    # group {1 (len 1), 0 (len 2)} -> centred {0.5, -0.5} -> tokens [0.5, -0.5, -0.5]
    # token mean -1/6, unbiased var 1/3 -> [2/3, -1/3, -1/3] / sqrt(1/3 + 1e-8)
    r, m = outcome([1.0, 0.0], [1, 2])
    adv, ret = compute_advantages("reinforce_plus_plus_baseline", r, m, group_ids=[7, 7], **adv_options())
    d = math.sqrt(1 / 3 + 1e-8)
    assert per_seq(adv, m) == pytest.approx([(2 / 3) / d, (-1 / 3) / d], abs=1e-12)
    assert torch.equal(adv, ret)


def _grpo_ref(scores, ids, norm):
    out = []
    for i, s in enumerate(scores):
        grp = [scores[j] for j in range(len(scores)) if ids[j] == ids[i]]
        if len(grp) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(grp) / len(grp)
            std = math.sqrt(sum((g - mean) ** 2 for g in grp) / (len(grp) - 1))
        out.append((s - mean) / (std + 1e-6) if norm else s - mean)
    return out


def _rloo_ref(scores, ids):
    out = []
    for i, s in enumerate(scores):
        others = [scores[j] for j in range(len(scores)) if ids[j] == ids[i] and j != i]
        out.append(s - (sum(others) / len(others) if others else 0.0))
    return out


def _opo_ref(scores, lengths, ids):
    out = []
    for i, s in enumerate(scores):
        members = [j for j in range(len(scores)) if ids[j] == ids[i]]
        if len(members) == 1:
            out.append(s)
        else:
            out.append(s - sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_group_estimators_match_loop_reference(seed):
    rng = np.random.default_rng(seed)
    batch = 12
    ids = list(rng.integers(0, 5, size=batch))
    scores = [float(x) for x in rng.choice([0.0, 0.5, 1.0, 2.0], size=batch)]
    lengths = [int(x) for x in rng.integers(1, 7, size=batch)]
    r, m = outcome(scores, lengths, length=8)
    for norm in (True, False):
        adv, _ = compute_advantages("grpo", r, m, group_ids=torch.tensor(ids), **adv_options(norm_adv_by_std=norm))
        assert per_seq(adv, m) == pytest.approx(_grpo_ref(scores, ids, norm), abs=1e-9)
    adv, _ = compute_advantages("rloo", r, m, group_ids=np.array(ids), **adv_options())
    assert per_seq(adv, m) == pytest.approx(_rloo_ref(scores, ids), abs=1e-9)
    adv, _ = compute_advantages("opo", r, m, group_ids=ids, **adv_options())
    assert per_seq(adv, m) == pytest.approx(_opo_ref(scores, lengths, ids), abs=1e-9)


def test_group_id_kinds_agree():
    r, m = outcome(GROUP_SCORES, GROUP_LENGTHS)
    base, _ = compute_advantages("grpo", r, m, group_ids=GROUP_IDS, **adv_options())
    as_tensor = torch.tensor([10, 10, 10, -3, 99, 99], dtype=torch.int64)
    as_numpy_obj = np.empty(6, dtype=object)
    as_numpy_obj[:] = [("p", 1), ("p", 1), ("p", 1), ("q", 2), ("r", 3), ("r", 3)]
    for ids in (as_tensor, as_numpy_obj, np.array(GROUP_IDS)):
        adv, _ = compute_advantages("grpo", r, m, group_ids=ids, **adv_options())
        assert torch.equal(adv, base)


def test_group_ids_wrong_length_or_dtype_rejected():
    r, m = outcome([1.0, 0.0], [1, 2])
    with pytest.raises(ValueError, match=r"group_ids has length 3 but the batch has 2 rows"):
        compute_advantages("grpo", r, m, group_ids=[0, 0, 1], **adv_options())
    with pytest.raises(ValueError, match=r"group_ids has shape \(3,\)"):
        compute_advantages("rloo", r, m, group_ids=torch.tensor([0, 0, 1]), **adv_options())
    with pytest.raises(ValueError, match="integer tensor"):
        compute_advantages("rloo", r, m, group_ids=torch.tensor([0.0, 1.0]), **adv_options())


def test_float32_inputs_stay_float32():
    r, m = outcome(GROUP_SCORES, GROUP_LENGTHS)
    adv, _ = compute_advantages("grpo", r.float(), m.bool(), group_ids=GROUP_IDS, **adv_options())
    assert adv.dtype == torch.float32
    ref, _ = compute_advantages("grpo", r, m, group_ids=GROUP_IDS, **adv_options())
    assert torch.allclose(adv.double(), ref, atol=1e-6)


# ---------------------------------------------------------------------- token-level estimators
def test_gae_hand_values_and_garbage_padding_ignored():
    # gamma 0.9, lam 0.8; t=1: delta = 1 - 0.2 = 0.8 = A1; t=0: delta = 0.9*0.2 - 0.5 = -0.32,
    # A0 = -0.32 + 0.72 * 0.8 = 0.256. returns = A + V = [0.756, 1.0]. Whitening two values gives
    # -+1/sqrt(2) (times sqrt(var / (var + 1e-8))).
    r = torch.tensor([[0.0, 1.0, 5.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.2, float("nan")]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0]])
    adv, ret = compute_advantages("gae", r, m, values=v, **adv_options(gamma=0.9, lam=0.8))
    close(ret, [[0.756, 1.0, 0.0]])
    var = 2 * 0.272**2
    s = math.sqrt(var / (var + 1e-8))
    close(adv, [[-INV_SQRT2 * s, INV_SQRT2 * s, 0.0]])


def _gae_ref(rewards, values, lengths, gamma, lam):
    adv = []
    for r, v, n in zip(rewards, values, lengths):
        row, last = [0.0] * n, 0.0
        for t in reversed(range(n)):
            nv = v[t + 1] if t + 1 < n else 0.0
            last = r[t] + gamma * nv - v[t] + gamma * lam * last
            row[t] = last
        adv.append(row)
    return adv


def _whiten_ref(rows):
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


@pytest.mark.parametrize("seed", range(3))
def test_gae_matches_loop_reference(seed):
    rng = np.random.default_rng(seed)
    batch, length = 5, 7
    lengths = [int(x) for x in rng.integers(1, length + 1, size=batch)]
    rewards = rng.normal(size=(batch, length))
    values = rng.normal(size=(batch, length))
    mask = np.zeros((batch, length))
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rewards_pad = np.where(mask > 0, rewards, 123.0)  # garbage in padding must not matter
    adv, ret = compute_advantages(
        "gae", torch.tensor(rewards_pad), torch.tensor(mask), values=torch.tensor(values),
        **adv_options(gamma=0.95, lam=0.9)
    )
    raw = _gae_ref(rewards, values, lengths, 0.95, 0.9)
    white = _whiten_ref(raw)
    for i, n in enumerate(lengths):
        expected_ret = [a + values[i, t] for t, a in enumerate(raw[i])]
        assert ret[i, :n].tolist() == pytest.approx(expected_ret, abs=1e-9)
        assert adv[i, :n].tolist() == pytest.approx(white[i], abs=1e-9)
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


def test_gae_does_not_carry_gradient():
    r, m = outcome([1.0, 0.0], [2, 2])
    v = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    adv, ret = compute_advantages("gae", r, m, values=v, **adv_options())
    assert not adv.requires_grad and not ret.requires_grad


def test_reinforce_plus_plus_hand_values():
    # gamma 0.5: row0 rewards [0, 1] -> returns [0.5, 1]; row1 [2] -> [2]
    # tokens {0.5, 1, 2}: mean 7/6, unbiased var 7/12
    r = torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv, ret = compute_advantages("reinforce_plus_plus", r, m, **adv_options(gamma=0.5))
    close(ret, [[0.5, 1.0], [2.0, 0.0]])
    d = math.sqrt(7 / 12 + 1e-8)
    expected = [[(0.5 - 7 / 6) / d, (1 - 7 / 6) / d], [(2 - 7 / 6) / d, 0.0]]
    close(adv, expected)


def test_remax_hand_values():
    r = torch.tensor([[0.5, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    baselines = torch.tensor([0.4, 3.0], dtype=torch.float64)
    adv, ret = compute_advantages("remax", r, m, reward_baselines=baselines, **adv_options())
    close(adv, [[1.1, 0.6, 0.6], [-1.0, -1.0, 0.0]])
    # returns are the reward-to-go without the baseline (verl's definition), 0 on padding
    close(ret, [[1.5, 1.0, 1.0], [2.0, 2.0, 0.0]])
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(3,\) but must be \(2,\)"):
        compute_advantages("remax", r, m, reward_baselines=torch.zeros(3), **adv_options())


def test_all_equal_rewards_give_zero_group_advantage():
    r, m = outcome([1.0, 1.0, 1.0], [1, 2, 3])
    for name in ("grpo", "rloo", "opo", "gpg"):
        adv, _ = compute_advantages(name, r, m, group_ids=[0, 0, 0], **adv_options())
        assert torch.all(adv == 0), name


# ---------------------------------------------------------------------- rejected inputs
ALL_INPUTS = dict(values=None, group_ids=[0, 0, 1], reward_baselines=torch.zeros(3))


@pytest.mark.parametrize(
    "name",
    ["gae", "grpo", "rloo", "remax", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg"],
)
def test_zero_length_response_rejected_with_row_index(name):
    r = torch.zeros(3, 4)
    m = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    inputs = dict(ALL_INPUTS, values=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"zero-length responses .*row index\(es\) \[1\]"):
        compute_advantages(name, r, m, **inputs, **adv_options())


@pytest.mark.parametrize("name", ["gae", "grpo", "reinforce_plus_plus"])
def test_shape_mismatch_names_both_shapes(name):
    r = torch.zeros(3, 5)
    m = torch.ones(3, 4)
    inputs = dict(ALL_INPUTS, values=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"token_level_rewards has shape \(3, 5\).*\(3, 4\)"):
        compute_advantages(name, r, m, **inputs, **adv_options())
