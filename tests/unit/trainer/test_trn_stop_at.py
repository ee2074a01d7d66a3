"""trainer.stop_at and timing honesty through RLTrainer.fit with fake roles (test_trn_step.py's):
a validation metric reaching its value or a spent wall-time budget ends the run after a
checkpoint, as a normal completion; validation time is its own metric, not part of the step's."""
import dataclasses
import json

import pytest

from test_trn_step import PROMPTS, _trainer
from verl_hpc.config import JobConfig
from verl_hpc.trainer.hooks.stopping import StopRule


def _fit(tmp_path, *overrides):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": p, "data_source": "synthetic_arith", "ground_truth": a})
                           + "\n" for p, a in PROMPTS.items()))
    trainer, calls, _ = _trainer(tmp_path, "algorithm.recipe=grpo", "rollout.n=2", "trainer.total_steps=5",
                                 "tracking.backends=[jsonl]", f"data.val_files=[{val}]", *overrides)
    saved = []
    trainer.checkpointer.maybe_save = lambda step, force=False: saved.append((step, force))
    trainer.checkpointer.close = lambda: None
    return trainer.fit(), saved, tmp_path / "out" / "metrics.jsonl"


def test_trn_stop_when_a_validation_metric_reaches_its_value(tmp_path, caplog):
    # the fake rollout answers sample 0 right: greedy validation accuracy is 1.0 from the start
    with caplog.at_level("INFO", logger="verl_hpc.trainer"):  # the stop hook's line (trainer/hooks/stopping.py)
        summary, saved, _ = _fit(tmp_path, "trainer.val_every=2", "trainer.stop_at.metric=val/acc/all",
                                 "trainer.stop_at.value=0.9")
    assert summary["steps"] == 2 and summary["stopped"] == "stop_at"  # first validation after a step
    assert "val/acc/all = 1 >= 0.9" in summary["stop_reason"]
    assert (2, True) in saved
    said = [r.getMessage() for r in caplog.records if "stopping after step" in r.getMessage()]
    assert len(said) == 1 and "requeue" not in said[0].lower() and "preempt" not in said[0].lower()


def test_trn_stop_when_the_wall_time_budget_is_spent(tmp_path):
    summary, saved, _ = _fit(tmp_path, "trainer.val_every=0", "trainer.stop_at.wall_time_s=1e-6")
    assert summary["steps"] == 1 and summary["stopped"] == "stop_at" and (1, True) in saved
    assert "trainer.stop_at.wall_time_s" in summary["stop_reason"]


@pytest.mark.heavy
def test_trn_validation_has_its_own_timing_out_of_the_step(tmp_path, monkeypatch):
    import time

    from verl_hpc.trainer.programs import rl

    real = rl.RLTrainer._validate

    # the fake step takes milliseconds; 1.5 s leaves room for a loaded machine: a step timed with
    # its validation in it would take >= 1.5 s
    def slow_validate(self, tracker, step):
        time.sleep(1.5)
        return real(self, tracker, step)

    monkeypatch.setattr(rl.RLTrainer, "_validate", slow_validate)
    summary, _, path = _fit(tmp_path, "trainer.val_every=1")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "timing_s/step" in r]
    assert len(steps) == 5 and summary["stopped"] == "completed"
    assert all(r["timing_s/validation"] >= 1.5 for r in steps)
    assert all(r["timing_s/step"] < 1.5 for r in steps[1:]), [r["timing_s/step"] for r in steps]


def _rule(**changes):
    """A StopRule from the default trainer.stop_at section (both rules off), `changes` on top."""
    return StopRule(**dict(dataclasses.asdict(JobConfig().trainer.stop_at), **changes))


def test_stop_rule_modes():
    rule = _rule(metric="val/reward/all", value=0.2, mode="min")
    assert rule.check(3, {"val/reward/all": 0.3}, 1.0) is None
    assert "<= 0.2" in rule.check(4, {"val/reward/all": 0.1}, 1.0)
    assert rule.check(5, {}, 1.0) is None  # no validation this step
    t = [0.0]
    budget = _rule(wall_time_s=10.0, clock=lambda: t[0])
    t[0] = 6.0
    assert budget.check(1, {}, 3.0) is None       # 6 + 3 <= 10: one more step fits
    t[0] = 8.0
    assert budget.check(2, {}, 3.0) is not None   # 8 + 3 > 10
    assert not _rule() and _rule(wall_time_s=1.0)


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.stop_at.metric=reward/score/mean", "trainer.stop_at.value=1", "trainer.val_every=1"],
     "must be a validation metric"),
    (["trainer.stop_at.metric=val/acc/all", "trainer.val_every=1"], "needs trainer.stop_at.value"),
    (["trainer.stop_at.metric=val/acc/all", "trainer.stop_at.value=1", "trainer.val_every=0"],
     "needs validation"),
])
def test_stop_at_bad_config_names_the_field(overrides, needle):
    from verl_hpc.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    assert needle in str(e.value) and "trainer.stop_at" in str(e.value)
