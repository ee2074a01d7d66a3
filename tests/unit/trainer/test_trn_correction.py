"""The RL step's mismatch-correction wiring (trainer/stages/correction.py) with a fake actor: bypass mode
skips the old-log-prob forward, the test fault rollout_logprob_shift (tests/faults.py) and the weights
handed to the actor update."""
import contextlib
import math
import types

import pytest
import torch

from faults import injected
from verl_hpc.config.schema import JobConfig
from verl_hpc.trainer.stages import correction


class FakeActor:
    def __init__(self):
        self.calls = 0

    def log_probs(self, batch):
        self.calls += 1
        return {"old_log_probs": torch.full_like(batch.mask, -1.0), "entropy": torch.ones_like(batch.mask)}


class FakeBatch(types.SimpleNamespace):
    """The StepBatch fields the correction reads and fills."""

    def fill(self, outputs):
        for key, value in outputs.items():
            setattr(self, key, value)

    def __len__(self):
        return len(self.mask)


def step_batch():
    return FakeBatch(mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
                     rollout_log_probs=torch.tensor([[-0.5, -2.0, 0.0], [-1.2, 0.0, 0.0]]),
                     old_log_probs=None, entropy=None, rollout_is_weights=None)


def timer(_name):
    return contextlib.nullcontext()


def test_bypass_uses_rollout_log_probs_without_a_forward():
    cfg, actor, batch, m = JobConfig(), FakeActor(), step_batch(), {}
    cfg.algorithm.rollout_correction.bypass_mode = True
    correction.old_log_probs(cfg, actor, batch, timer, m)
    assert actor.calls == 0 and torch.equal(batch.old_log_probs, batch.rollout_log_probs)
    out = correction.apply(cfg, batch)
    assert "rollout/logprob_diff_max" not in out and out["rollout_corr/kl_k1"] == 0.0
    assert batch.rollout_is_weights is None


def test_forward_then_token_tis_weights():
    cfg, actor, batch, m = JobConfig(), FakeActor(), step_batch(), {}
    cfg.algorithm.rollout_correction.rollout_is = "token"
    correction.old_log_probs(cfg, actor, batch, timer, m)
    assert actor.calls == 1 and m["actor/entropy"] == 1.0
    out = correction.apply(cfg, batch)
    w = batch.rollout_is_weights
    # rho = exp(old - rollout) = exp(-1 + 0.5), exp(-1 + 2) -> truncated at 2, exp(-1 + 1.2)
    expected = [[math.exp(-0.5), 2.0, 0.0], [math.exp(0.2), 0.0, 0.0]]
    torch.testing.assert_close(w, torch.tensor(expected))
    assert out["rollout/logprob_diff_max"] == pytest.approx(1.0)
    assert out["rollout_corr/is_truncated_frac"] == pytest.approx(1 / 3)


def test_fault_replaces_rollout_log_probs_by_old_minus_shift():
    cfg, actor, batch, m = JobConfig(), FakeActor(), step_batch(), {}
    with injected(rollout_logprob_shift=0.25):
        correction.old_log_probs(cfg, actor, batch, timer, m)
        out = correction.apply(cfg, batch)
    assert out["rollout_corr/kl_k1"] == pytest.approx(-0.25)
    assert torch.equal(batch.rollout_log_probs, torch.tensor([[-1.25, -1.25, 0.0], [-1.25, 0.0, 0.0]]))


def test_fault_forces_the_forward_and_refuses_bypass():
    """The shift replaces what the forward computed: the path is the forward's even where the
    on-policy shortcut would do, and a run that takes pi_old from the rollout is refused."""
    cfg, batch = JobConfig(), step_batch()
    assert correction.old_log_prob_path(cfg, batch, False)[0] == "update"
    with injected(rollout_logprob_shift=0.25):
        path, why = correction.old_log_prob_path(cfg, batch, False)
        assert path == "forward" and "rollout_logprob_shift" in why
        cfg.algorithm.rollout_correction.bypass_mode = True
        with pytest.raises(RuntimeError, match="needs the old-log-prob forward"):
            correction.old_log_prob_path(cfg, batch, False)


def test_m2po_mask_of_the_whole_batch_and_icepop_without_the_decoupled_weights():
    """policy_loss m2po: the step's mask over the whole batch (the rollout's outlier token goes);
    with split placement's decoupled objective the proximal / behaviour weights stay for m2po, while
    icepop's own weights replace them."""
    from verl_hpc.algorithms.m2po import m2po_keep

    cfg, batch = JobConfig(), step_batch()
    batch.old_log_probs = torch.tensor([[-0.6, -1.0, 0.0], [-1.1, 0.0, 0.0]])
    cfg.actor.policy_loss = "m2po"
    out = correction.apply(cfg, batch)
    want, _ = m2po_keep(batch.old_log_probs, batch.rollout_log_probs, batch.mask, cfg.actor.m2_threshold)
    assert torch.equal(batch.m2po_keep, want) and batch.m2po_keep.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert out["m2po/masked_frac"] == pytest.approx(1 / 3) and batch.rollout_is_weights is None
    cfg.async_training.staleness = 2  # off-policy: the decoupled objective's token weights
    correction.apply(cfg, batch)
    assert batch.rollout_is_weights is not None
    cfg.actor.policy_loss, batch.rollout_is_weights = "icepop", None
    correction.apply(cfg, batch)
    assert batch.rollout_is_weights is None


def test_the_optimal_token_baseline_asks_the_forward_for_sum_pi_squared():
    class Actor(FakeActor):
        def log_probs(self, batch, sum_pi_squared=False):
            out = super().log_probs(batch)
            return dict(out, sum_pi_squared=torch.full_like(batch.mask, 0.5)) if sum_pi_squared else out

    cfg, actor, batch = JobConfig(), Actor(), step_batch()
    cfg.algorithm.adv_estimator = "tir_optimal_token_baseline"
    correction.old_log_probs(cfg, actor, batch, timer, {})
    assert torch.equal(batch.sum_pi_squared, torch.full_like(batch.mask, 0.5))
