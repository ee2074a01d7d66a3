"""The mismatch's per-step measure under a quantized rollout: the on-policy update reports the
rollout/training KL the separate old-log-prob pass reports (same values, same names), and
rollout_corr/kl_trend shows a drift like verl's per-tensor FP8 run (0.0100 -> 0.0313 over 32 steps)
as about 3, and a flat run as 1."""
import math

import pytest
import torch

from verl_hpc.algorithms.mismatch import rollout_correction
from verl_hpc.algorithms.objectives import _on_policy_metrics
from verl_hpc.trainer.hooks.mismatch_trend import TREND, WINDOW, MismatchTrendHook
from verl_hpc.trainer.stages.correction import on_policy_metrics


def _run(values):
    hook, seen = MismatchTrendHook(), []
    for step, v in enumerate(values, 1):
        m = {"rollout_corr/kl_k3": v}
        hook(step, m, run=None)
        seen.append(m.get(TREND))
    return seen


def test_a_drift_shows_as_its_ratio_and_a_flat_run_as_one():
    drift = [0.0100 * (3.13 ** (s / 31)) for s in range(32)]  # verl's 0.0100 -> 0.0313 in 32 steps
    seen = _run(drift)
    assert seen[:WINDOW - 1] == [None] * (WINDOW - 1) and seen[WINDOW - 1] == pytest.approx(1.0)
    first, last = sum(drift[:WINDOW]) / WINDOW, sum(drift[-WINDOW:]) / WINDOW
    assert seen[-1] == pytest.approx(last / first) and 2.5 < seen[-1] < 3.1
    flat = _run([0.01, 0.012, 0.009, 0.011, 0.01] * 6)
    assert all(abs(v - 1) < 0.1 for v in flat[WINDOW - 1:])


def test_steps_without_the_measure_are_skipped():
    hook = MismatchTrendHook(window=2)
    for step, m in enumerate([{}, {"rollout_corr/kl_k3": float("nan")}, {"rollout_corr/kl_k3": 0.01},
                              {"rollout_corr/kl_k3": 0.03}, {"rollout_corr/kl_k3": 0.05}], 1):
        hook(step, m, run=None)
    assert m[TREND] == pytest.approx((0.03 + 0.05) / 2 / 0.02)


def test_the_on_policy_update_reports_the_separate_passs_kl():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    rollout = old + 0.05 * torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    ours = _on_policy_metrics(old, {}, {"rollout_log_probs": rollout}, mask)
    m = {f"actor/{k}": float(v) for k, v in ours.items()}
    on_policy_metrics(m)
    _, theirs = rollout_correction(old, rollout, mask, None, 2.0, None, None, None)
    for key in ("rollout_corr/kl_k1", "rollout_corr/kl_k3"):
        assert m[key] == pytest.approx(float(theirs[key]), rel=1e-5), key
    assert m["rollout_corr/kl_k3"] > 0 and math.isfinite(m["rollout/logprob_diff_mean"])
