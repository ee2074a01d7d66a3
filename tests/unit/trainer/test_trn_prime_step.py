"""PRIME in `RLTrainer.step` with fake roles (tests/unit/trainer/test_trn_step.py): the implicit
PRM runs after the reference and before the advantages, trains before or after its rewards are
taken (prm.update), and alone in its warm-up steps; what it is handed and what reaches the actor."""
import pytest
import torch

from verl_hpc.tracking import StageTimer
from test_trn_step import _trainer

PRIME = ["algorithm.recipe=prime", "rollout.n=2", "prm.ppo_mini_batch_size=2", "actor.ppo_mini_batch_size=2"]


def _after_sleep(calls):
    return calls[calls.index("rollout.sleep") + 1:]


@pytest.mark.parametrize("update, order", [
    ("before", ["prm.log_probs", "prm.update", "prm.log_probs"]),  # rewards from the updated PRM
    ("after", ["prm.log_probs", "prm.update"]),  # rewards from the first forward
    ("none", ["prm.log_probs"]),
])
def test_trn_prm_runs_after_the_reference_and_before_the_advantages(tmp_path, update, order):
    trainer, calls, seen = _trainer(tmp_path, *PRIME, f"prm.update={update}")
    timer = StageTimer()
    m = trainer.step(1, timer)
    assert _after_sleep(calls) == ["ref.log_probs", *order, "actor.update"]
    stages = [k for k in timer.pop() if k != "timing_s/step"]
    assert stages.index("timing_s/ref") < stages.index("timing_s/prm") < stages.index("timing_s/adv")
    # the fake rollout answers each prompt right once and wrong once: half the labels are 1, and the
    # fake PRM is 0.1 above the reference on every token, so it cannot tell them apart (AUC 0.5)
    assert m["prm/label_mean"] == 0.5 and m["prm/auc"] == 0.5 and m["prm/group_auc"] == 0.5
    assert m["prm/token_reward_mean"] == pytest.approx(0.05 * 0.1)
    if update != "none":
        handed = seen["prm.update"][0]
        assert handed["outcome_labels"].tolist() == [1.0, 0.0, 1.0, 0.0]
        assert torch.equal(handed["ref_log_probs"], -0.6 * handed["response_mask"])
        assert type(seen["prm.update"][1]).__name__ == "PrmObjective"
    # PRIME's advantages reach the actor: right answers above wrong ones
    adv = seen["actor.update"][0]["advantages"]
    assert adv[0].max() > 0 > adv[1].min() and adv[2].max() > 0 > adv[3].min()


def test_trn_pairwise_prm_gets_its_partners(tmp_path):
    trainer, _, seen = _trainer(tmp_path, *PRIME, "prm.loss=pairwise")
    trainer.step(1, StageTimer())
    # every response's partner is the other answer to its prompt; before the update both score the same
    partners = seen["prm.update"][0]["prm_partners"]
    assert partners.shape == (4,) and torch.allclose(partners, torch.full((4,), 0.05 * 0.1), atol=1e-6)


def test_trn_prm_warmup_trains_the_prm_alone(tmp_path):
    trainer, calls, _ = _trainer(tmp_path, *PRIME, "prm.warmup_steps=1", "trainer.total_steps=2")
    m = trainer.step(1, StageTimer())
    assert _after_sleep(calls) == ["ref.log_probs", "prm.log_probs", "prm.update", "prm.log_probs"]
    assert m["prm/warmup"] == 1.0 and "train/samples" in m and trainer.steps_done == 1
    calls.clear()
    m = trainer.step(2, StageTimer())
    assert "actor.update" in calls and "prm/warmup" not in m
    assert "rollout.load_weights" not in calls, "the warm-up left the actor as it was: nothing to sync"


@pytest.mark.parametrize("correct_at, acc, labels", [(1.0, 1.0, 0.5), (1.5, 0.0, 0.0)])
def test_trn_correct_at_is_validations_accuracy_and_the_prms_labels(tmp_path, correct_at, acc, labels):
    """reward.correct_at: a score of 1 (a right answer) is correct at the default threshold and not
    at 1.5, for greedy validation and for the PRM's labels alike."""
    trainer, _, _ = _trainer(tmp_path, *PRIME, "algorithm.accuracy_filter.enable=false", f"reward.correct_at={correct_at}",
                             "trainer.val_every=1", f"data.val_files=[{tmp_path}/train.jsonl]")
    val = trainer._validate(None, 0)  # greedy: the fake rollout's sample 0, the right answer
    assert val["val/acc/all"] == acc and val["val/reward/all"] == 1.0
    assert trainer.step(1, StageTimer())["prm/label_mean"] == labels
