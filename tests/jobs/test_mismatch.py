"""Rollout/training mismatch correction through the real RL trainer: with the rollout engine agreeing
exactly with the trainer (the test fault rollout_logprob_shift=0, tests/faults.py), correction on
trains bitwise like correction off; with a known perturbation (rollout = old - 0.5) the logged weights
and masks equal the hand computation.
(Bypass mode's wiring is tested without an engine in tests/unit/trainer/test_trn_correction.py.)"""
import math
from pathlib import Path

import h5py
import numpy as np
import pytest

from faults import injected
from jobs import logs, metrics, run_here, small


@pytest.fixture
def assets(tiny_assets):
    return tiny_assets


def run(assets, out: Path, shift: float, *extra):
    """One step with the rollout's log-probs := the actor's old log-probs - shift."""
    with injected(rollout_logprob_shift=shift):
        proc, summary = run_here("configs/demo_rl.yaml", out, *small(assets, "rollout.n=2", "trainer.total_steps=1",
                                                                     *extra))
    assert proc.returncode == 0, logs(proc, out)
    assert summary["steps"] == 1
    return [r for r in metrics(out) if r.get("step", 0) >= 1]


def checkpoint_arrays(out: Path):
    """Every dataset of every HDF5 file of the checkpoints, by file and dataset path, except the copy
    of the metric log (it holds timings and the correction's own metrics)."""
    arrays = {}
    files = sorted((out / "checkpoints").rglob("*.h5"))
    assert files, f"no checkpoint under {out}"
    for f in files:
        with h5py.File(f, "r") as h:
            h.visititems(lambda name, obj: arrays.__setitem__(f"{f.relative_to(out)}:{name}", obj[()])
                         if isinstance(obj, h5py.Dataset) and not name.endswith("metrics_jsonl") else None)
    return arrays


def test_trn_correction_is_identity_when_engines_agree(assets, tmp_path):
    off = run(assets, tmp_path / "off", 0.0)
    on = run(assets, tmp_path / "on", 0.0, "algorithm.rollout_correction.rollout_is=token",
             "algorithm.rollout_correction.rollout_rs=sequence")
    for row in on:
        assert row["rollout_corr/is_weight_mean"] == 1.0 and row["rollout_corr/rs_masked_frac"] == 0.0
        assert row["rollout/logprob_diff_max"] == 0.0
    assert [r["actor/pg_loss"] for r in on] == [r["actor/pg_loss"] for r in off]
    a, b = checkpoint_arrays(tmp_path / "off"), checkpoint_arrays(tmp_path / "on")
    assert a.keys() == b.keys() and len(a) > 0
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, differ[:5]


def test_trn_perturbed_rollout_weights_and_masks_by_hand(tiny_assets, tmp_path):
    rows = run(tiny_assets, tmp_path / "shift", 0.5,
               "algorithm.rollout_correction.rollout_is=token",
               "algorithm.rollout_correction.rollout_is_threshold=1.5",
               "algorithm.rollout_correction.rollout_rs=token",
               "algorithm.rollout_correction.rollout_rs_threshold=1.6")
    # rho_t = exp(old - rollout) = e^0.5 = 1.6487 on every token: the IS weight is truncated to 1.5
    # everywhere, and 1.6487 > 1.6 rejects every token, so the policy loss is exactly 0
    for row in rows:
        assert row["rollout_corr/is_weight_mean"] == pytest.approx(1.5, rel=1e-6)
        assert row["rollout_corr/is_weight_max"] == pytest.approx(1.5, rel=1e-6)
        assert row["rollout_corr/is_truncated_frac"] == 1.0
        assert row["rollout_corr/rs_masked_frac"] == 1.0 and row["rollout_corr/rs_masked_seq_frac"] == 1.0
        assert row["rollout_corr/kl_k1"] == pytest.approx(-0.5, abs=1e-5)
        assert row["rollout_corr/kl_k3"] == pytest.approx(math.exp(0.5) - 1.5, abs=1e-5)
        assert row["rollout/logprob_diff_max"] == pytest.approx(0.5, abs=1e-5)
        assert row["actor/pg_loss"] == 0.0
