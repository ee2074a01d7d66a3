"""Rollout/training mismatch correction (algorithms/mismatch.py) against hand computations, with a
known perturbation of the rollout log-probs."""
import math

import pytest
import torch

from verl_hpc.algorithms import compute_policy_loss, rollout_correction
from verl_hpc.config import ConfigError, load_config
from alg_options import ROLLOUT_CORRECTION, pg_options

D = torch.float64

# old log-probs (any values) and a perturbation delta: rollout = old - delta, so rho_t = exp(delta_t)
DELTA = [[0.5, -1.0, 0.9, 0.0], [0.1, 0.2, 9.9, 9.9], [-2.0, 0.3, 0.0, 0.0]]
LENGTHS = [4, 2, 3]


def case():
    old = torch.tensor([[-0.3, -1.2, -0.7, -2.0], [-0.1, -0.5, 0.0, 0.0], [-1.5, -0.2, -0.9, 0.0]], dtype=D)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(4)] for n in LENGTHS], dtype=D)
    rollout = old - torch.tensor(DELTA, dtype=D)
    rollout[mask == 0] = float("nan")  # garbage on padding
    return old, rollout, mask


def correction(old, rollout, mask, **settings):
    """rollout_correction with the default algorithm.rollout_correction section's settings (all off),
    `settings` on top."""
    rc = ROLLOUT_CORRECTION
    s = dict(rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold, rollout_rs=rc.rollout_rs,
             rollout_rs_threshold=rc.rollout_rs_threshold, rollout_rs_threshold_lower=rc.rollout_rs_threshold_lower)
    return rollout_correction(old, rollout, mask, **dict(s, **settings))


def valid(i):
    return range(LENGTHS[i])


def test_token_tis_weights_and_metrics_by_hand():
    old, rollout, mask = case()
    w, m = correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    for i in range(3):
        for t in range(4):
            expected = min(math.exp(DELTA[i][t]), 2.0) if t < LENGTHS[i] else 0.0
            assert w[i, t].item() == pytest.approx(expected, rel=1e-12)
    ws = [min(math.exp(DELTA[i][t]), 2.0) for i in range(3) for t in valid(i)]
    assert m["rollout_corr/is_weight_mean"].item() == pytest.approx(sum(ws) / 9, rel=1e-6)
    assert m["rollout_corr/is_weight_max"].item() == pytest.approx(2.0)
    assert m["rollout_corr/is_truncated_frac"].item() == pytest.approx(1 / 9)  # only exp(0.9) > 2
    ds = [DELTA[i][t] for i in range(3) for t in valid(i)]
    assert m["rollout_corr/kl_k1"].item() == pytest.approx(-sum(ds) / 9, rel=1e-6)
    assert m["rollout_corr/kl_k3"].item() == pytest.approx(sum(math.exp(d) - d - 1 for d in ds) / 9, rel=1e-6)
    assert m["rollout_corr/log_ratio_abs_max"].item() == pytest.approx(2.0)


def test_sequence_tis_by_hand():
    old, rollout, mask = case()
    w, m = correction(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=1.5)
    seq = [sum(DELTA[i][t] for t in valid(i)) for i in range(3)]  # 0.4, 0.3, -1.7
    for i in range(3):
        expected = min(math.exp(seq[i]), 1.5)
        assert w[i, :LENGTHS[i]].tolist() == pytest.approx([expected] * LENGTHS[i], rel=1e-12)
        assert torch.all(w[i, LENGTHS[i]:] == 0)
    assert m["rollout_corr/is_truncated_frac"].item() == pytest.approx(0.0)  # e^0.4 = 1.49 < 1.5


@pytest.mark.parametrize("level,lo,hi,kept", [
    ("token", 0.5, 2.0, {(0, 0), (0, 3), (1, 0), (1, 1), (2, 1), (2, 2)}),  # |delta| <= log 2
    ("sequence", 0.5, 1.45, {(1, 0), (1, 1)}),  # seq sums 0.4 (e^.4=1.49 > 1.45), 0.3, -1.7
    ("geometric", 0.8, 1.2, {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)}),  # means .1, .15, -.57
])
def test_rejection_masks_by_hand(level, lo, hi, kept):
    old, rollout, mask = case()
    w, m = correction(old, rollout, mask, rollout_rs=level, rollout_rs_threshold=hi,
                              rollout_rs_threshold_lower=lo)
    got = {(i, t) for i in range(3) for t in valid(i) if w[i, t] == 1.0}
    assert got == kept
    assert all(w[i, t] == 0.0 for i in range(3) for t in valid(i) if (i, t) not in kept)
    assert m["rollout_corr/rs_masked_frac"].item() == pytest.approx(1 - len(kept) / 9)
    rejected_rows = {i for i in range(3) for t in valid(i) if (i, t) not in kept}
    assert m["rollout_corr/rs_masked_seq_frac"].item() == pytest.approx(len(rejected_rows) / 3)


def test_tis_and_rejection_combine_and_default_lower_bound():
    old, rollout, mask = case()
    w, _ = correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0,
                              rollout_rs="token", rollout_rs_threshold=2.0)  # lower: 1/2
    for i in range(3):
        for t in valid(i):
            r = math.exp(DELTA[i][t])
            expected = min(r, 2.0) if 0.5 <= r <= 2.0 else 0.0
            assert w[i, t].item() == pytest.approx(expected, rel=1e-12)


def test_engines_that_agree_give_unit_weights_and_an_unchanged_loss():
    old, _, mask = case()
    w, m = correction(old, old.clone(), mask, rollout_is="sequence", rollout_rs="token")
    assert torch.equal(w, mask)  # exactly 1 on valid tokens
    assert m["rollout_corr/kl_k1"].item() == 0.0 and m["rollout_corr/rs_masked_frac"].item() == 0.0
    logp = (old + 0.1).requires_grad_(True)
    adv = torch.ones_like(old)
    a, _ = compute_policy_loss("vanilla", old, logp, adv, mask, **pg_options("vanilla"))
    b, _ = compute_policy_loss("vanilla", old, logp, adv, mask, **pg_options("vanilla"), rollout_is_weights=w)
    assert torch.equal(a, b)


def test_off_gives_no_weights_and_bad_settings_are_named():
    old, rollout, mask = case()
    w, m = correction(old, rollout, mask)
    assert w is None and "rollout_corr/kl_k1" in m
    # level names are the section's choices: the config refuses an unknown one when it is loaded
    with pytest.raises(ConfigError, match="rollout_correction.rollout_is: invalid value 'seq'; valid: auto, token, sequence"):
        load_config(None, ["algorithm.rollout_correction.rollout_is=seq"])
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower < rollout_rs_threshold"):
        correction(old, rollout, mask, rollout_rs="token", rollout_rs_threshold=2.0,
                           rollout_rs_threshold_lower=3.0)
