"""The per-step hooks (trainer/hooks/base.py): the runner's order and verdicts with fake hooks; the RL
trainer's hook order; the rollback hook through the real trainer in this process (one gloo rank,
the tiny model: test_trn_nonfinite.py's set-up); the program runner's summary file and result line."""
import json
import types

import pytest
import torch

from faults import injected
from test_trn_nonfinite import _rows, _trainer
from verl_hpc.trainer.hooks.base import CONTINUE, PreemptionHook, Rewind, RunState, Stop, run_steps

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self, name, seen, stage=None, verdicts=None):
        self.name, self.seen, self.stage, self.verdicts = name, seen, stage, dict(verdicts or {})

    def __call__(self, step, metrics, run):
        self.seen.append((self.name, step, dict(metrics)))
        metrics[self.name] = step  # the hooks after this one see it
        return self.verdicts.pop(step, CONTINUE)


def _run(hooks, total=4, start=0):
    stages = []
    run = RunState(tracker=None, timer=None, watchdog=types.SimpleNamespace(stage=stages.append),
                   summary={"stopped": "completed"}, total_steps=total, start=start)
    run_steps(lambda step: {"step": step}, hooks, run)
    return run.summary, stages


def test_hooks_run_in_order_after_each_step_and_see_what_earlier_ones_added():
    seen = []
    summary, stages = _run([Recorder("a", seen, stage="one"), Recorder("b", seen)], total=2, start=0)
    assert [(n, s) for n, s, _ in seen] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert "a" in seen[1][2] and "a" not in seen[0][2]
    assert stages == ["one", "one"] and summary == {"stopped": "completed"}


def test_rewind_runs_on_after_the_step_and_skips_the_later_hooks():
    seen = []
    _run([Recorder("a", seen, verdicts={3: Rewind(1)}), Recorder("b", seen)], total=4)
    assert [(n, s) for n, s, _ in seen] == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3),
                                            ("a", 2), ("b", 2), ("a", 3), ("b", 3), ("a", 4), ("b", 4)]


def test_stop_ends_the_loop_with_its_outcome_and_reason():
    seen = []
    summary, _ = _run([Recorder("a", seen, verdicts={2: Stop("stop_at", "why")}), Recorder("b", seen)])
    assert [(n, s) for n, s, _ in seen] == [("a", 1), ("b", 1), ("a", 2)]
    assert summary == {"stopped": "stop_at", "stop_reason": "why"}
    summary, _ = _run([Recorder("a", [], verdicts={1: Stop("preempted")})])
    assert summary == {"stopped": "preempted"}  # no stop_reason without a reason


def test_a_signal_in_the_last_step_leaves_the_run_finished():
    """Issue 93: a signal that came while the last step ran stopped the run as `preempted` at step
    N of N: a Slurm job requeued itself only to find nothing to do, and the local submitter said
    "stopped early at step 6 of 6" and exited 140. The last step is saved by the checkpoint hook
    before this one; the flag (here set from step 2 on) is not even asked there."""
    asked = []
    checkpointer = types.SimpleNamespace(stop_if_preempted=lambda step: asked.append(step) or step >= 2)
    summary, _ = _run([PreemptionHook(checkpointer)], total=2)
    assert summary == {"stopped": "completed"} and asked == [1]
    asked.clear()
    summary, _ = _run([PreemptionHook(checkpointer)], total=3)  # before the last step it still stops
    assert summary == {"stopped": "preempted"} and asked == [1, 2]


def test_rl_hook_order(one_rank_world, tmp_path, tiny_model):
    trainer = _trainer(tmp_path, tiny_model, set(), "trainer.rollback.enable=true", "trainer.val_every=2",
                       f"data.val_files=[{tmp_path}/train.jsonl]")
    names = [type(h).__name__ for h in trainer.hooks(stop_rule=None)]
    assert names == ["ValidationHook", "RollbackHook", "MismatchTrendHook", "LogHook", "CheckpointHook", "StopHook",
                     "PreemptionHook"]


@pytest.mark.heavy
def test_rollback_hook_rewinds_through_the_real_trainer(one_rank_world, tmp_path, tiny_model):
    trainer = _trainer(tmp_path, tiny_model, set(), "trainer.total_steps=5", "checkpoint.save_every=1",
                       "checkpoint.keep_last=0", "trainer.rollback.enable=true", "trainer.rollback.rollback_steps=2",
                       "trainer.rollback.lr_scale=0.5", "trainer.rollback.max_rollbacks=1",
                       "actor.optim.lr_decay_style=constant",
                       "actor.entropy_coeff=0.01")  # the rewards are all 0: the entropy bonus moves the weights
    synced, sync = [], trainer.rollout_weights.weight_sync

    def recording_sync(actor, rollout):  # what each (lazy) sync hands the rollout
        synced.append({n: t.clone() for n, t in actor.engine.export_hf_weights()})
        return sync(actor, rollout)

    trainer.rollout_weights.weight_sync = recording_sync
    with injected(regression_at_steps=[4]):  # a reward collapse at step 4 (tests/faults.py)
        summary = trainer.fit()
    assert summary["steps"] == 5 and summary["rollbacks"] == [
        {"at": 4, "to": 2, "metric": "reward/score/mean", "rule": "drop", "value": -1.0}]
    assert len(summary["history"]) == 5  # the undone steps' entries were dropped, then run again
    # one sync at the start of each step run: 1 2 3 4, then 3 4 again, 5; the rerun step 3 starts
    # from the loaded step-2 checkpoint, bitwise the weights the first step 3 started from
    assert len(synced) == 7
    assert all(torch.equal(synced[4][n], synced[2][n]) for n in synced[2])
    assert any(not torch.equal(synced[3][n], synced[2][n]) for n in synced[2])  # the weights moved
    rows = _rows(tmp_path)
    assert sorted(rows) == [1, 2, 3, 4, 5] and all(r["reward/score/mean"] > -1 for r in rows.values())
    assert [rows[i]["train/rollbacks"] for i in range(1, 6)] == [0, 0, 1, 1, 1]
    assert rows[3]["actor/lr"] == pytest.approx(rows[2]["actor/lr"] / 2)


def test_program_finish_writes_the_summary_and_one_result_line(tmp_path, capsys):
    from verl_hpc.config import load_config
    from verl_hpc.trainer.programs.base import finish, tracked

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "tracking.backends=[jsonl]"])
    ctx = types.SimpleNamespace(rank=0)
    summary = {"steps": 0, "stopped": "completed"}
    with tracked(cfg, ctx, summary, total_steps=2) as tracker:
        for step in (1, 2):
            tracker.log({"sft/loss": 1.0 / step}, step)
            summary["steps"] = step
    requeued = []
    summary["history"] = [{"a": 1}]
    assert finish(cfg, ctx, "dpo", summary, requeue=lambda: requeued.append(1)) is summary
    assert json.loads((tmp_path / "dpo_summary.json").read_text()) == summary
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("DPO_RESULT ")]
    shown = json.loads(line[len("DPO_RESULT "):])
    peaks = shown.pop("host_peak_gib_per_rank")  # each rank's peak resident memory, GiB
    assert len(peaks) == 1 and 0.01 < peaks[0] < 1000
    assert shown == {"steps": 2, "stopped": "completed"}  # no history
    assert requeued == [1] and (tmp_path / "metrics.jsonl").exists()
