"""Operating a run (issue 16), end to end through the real RL trainer, 1 rank, tiny model:

- two tasks (synthetic difficulty 1 and 2) with plateau task weights: per-task metrics and weights
  in the metrics file, the weights move, and a run resumed from the step-2 checkpoint reproduces
  the uninterrupted one bitwise (weights, Adam moments, task weights, metrics);
- the rollback guard: a reward collapse injected at step 4 (tests/faults.py) rolls back to step 2 (rollback_steps 2),
  alerts a local webhook, halves the LR, skips the undone data and finishes; with max_rollbacks 0
  the job fails naming the metric.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import injected
from ops_services import webhook_receiver

from jobs import REPO, logs, metrics, read_all, run_here, stable_metrics
from verl_hpc.checkpoint import read_metadata


@pytest.fixture(scope="module")
def assets(tiny_assets):
    root = tiny_assets
    if not (root / "data1" / "train.parquet").exists():  # the easy task: difficulty 1
        subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "synthetic", str(root / "data1"),
                        "--n-train", "200", "--n-val", "20", "--difficulty", "1"], cwd=REPO, check=True,
                       capture_output=True)
    return root


def tiny(root, *extra):
    return [f"model.path={root}/model", "rollout.engine=hf", "data.train_batch_size=4", "rollout.n=4",
            "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=8", "tracking.backends=[jsonl]",
            "actor.entropy_coeff=0.01", "actor.optim.lr=1e-3", "actor.optim.lr_decay_style=constant",
            "checkpoint.save_every=1", "checkpoint.keep_last=0", *extra]


def two_tasks(root):
    return ["data.train_files=[]", "data.val_files=[]",
            f"data.tasks={{easy: {{train_files: [{root}/data1/train.parquet], val_files: [{root}/data1/val.parquet]}}, "
            f"hard: {{train_files: [{root}/data/train.parquet], val_files: [{root}/data/val.parquet]}}}}",
            "data.task_weights.schedule=plateau", "data.task_weights.patience=2", "data.task_weights.min_weight=0.25",
            # the tiny model never answers right: this reward scores the easy task 1, the hard one 0
            "safety.allow_custom_code=true", "reward.custom_function=task_rewards:easy_is_solved",
            "trainer.val_every=2", "data.val_batch_size=50"]


def test_two_tasks_weights_move_and_resume_is_bitwise(assets, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    args = tiny(assets, *two_tasks(assets), "trainer.total_steps=5")
    proc, s = run_here("configs/demo_rl.yaml", straight, *args)
    assert proc.returncode == 0, logs(proc, straight)
    rows = {r["step"]: r for r in metrics(straight)}
    assert rows[1]["task/easy/share"] == rows[1]["task/hard/share"] == 0.5
    assert rows[1]["task/easy/reward"] == 1.0 and rows[1]["task/hard/reward"] == 0.0
    assert rows[2]["val/task/easy/acc"] == 1.0 and rows[2]["val/task/hard/acc"] == 0.0
    assert all(f"task/{t}/{k}" in rows[s_] for s_ in range(1, 6) for t in ("easy", "hard")
               for k in ("reward", "acc", "response_length", "share", "weight"))
    # easy is saturated from step 1: lowered after 2 steps, its share goes to hard, never below 0.25
    assert rows[2]["task/easy/weight"] == 0.5 and rows[2]["task/hard/weight"] == 1.5
    assert rows[3]["task/easy/share"] == 0.25  # step 3 drew with the step-2 weights
    assert rows[5]["task/easy/weight"] == 0.25 and rows[5]["task/hard/weight"] == 1.75
    assert Path(s["plot"]).is_file()

    proc, s2 = run_here("configs/demo_rl.yaml", split, *args, f"trainer.resume={straight}/checkpoints/step_000002",
                        f"checkpoint.dir={split}/checkpoints")
    assert proc.returncode == 0, logs(proc, split)
    assert s2["resumed_from"] == 2 and s2["steps"] == 5
    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b) and any(n.startswith("actor/optim/exp_avg/") for n in a)
    assert not [n for n in a if not torch.equal(a[n], b[n])], "not bitwise equal after resume"
    ta = read_metadata(straight / "checkpoints")["trainer_state"]
    tb = read_metadata(split / "checkpoints")["trainer_state"]
    assert ta["task_weights"] == tb["task_weights"] and ta["loader"] == tb["loader"]
    assert ta["task_weights"]["weights"] == {"easy": 0.25, "hard": 1.75}
    assert stable_metrics(straight) == stable_metrics(split)


def test_rollback_on_injected_regression_then_give_up(assets, tmp_path):
    out = tmp_path / "out"
    guard = ["trainer.rollback.enable=true", "trainer.rollback.rollback_steps=2", "trainer.rollback.lr_scale=0.5",
             "trainer.rollback.skip_data=true", "trainer.val_every=0"]
    with webhook_receiver() as (hook, alerts), injected(regression_at_steps=[4]):
        proc, s = run_here("configs/demo_rl.yaml", out, *tiny(assets, f"data.train_files=[{assets}/data/train.parquet]", "data.val_files=[]",
                                                             *guard, "trainer.total_steps=5",
                                                             "trainer.rollback.max_rollbacks=1",
                                                             f"tracking.alert_webhook={hook}"))
    assert proc.returncode == 0, logs(proc, out)
    assert s["steps"] == 5 and s["rollbacks"] == [{"at": 4, "to": 2, "metric": "reward/score/mean", "rule": "drop",
                                                   "value": -1.0}], s
    (ctype, body), = alerts
    assert body["event"] == "rollback" and body["step"] == 4 and body["details"]["to_step"] == 2
    assert body["details"]["metric"] == "reward/score/mean"
    rows = {r["step"]: r for r in metrics(out) if r["step"] >= 1}
    assert [r["step"] for r in metrics(out) if r["step"] >= 1] == [1, 2, 3, 4, 5]  # undone rows are gone
    assert [rows[i]["train/rollbacks"] for i in range(1, 6)] == [0, 0, 1, 1, 1]
    assert rows[3]["actor/lr"] == rows[2]["actor/lr"] / 2  # lr_scale after the rollback
    assert all(r["reward/score/mean"] > -1 for r in rows.values())  # the collapse was never logged
    ts = read_metadata(out / "checkpoints")["trainer_state"]
    assert ts["rollback"]["count"] == 1 and ts["rollback"]["lr_factor"] == 0.5
    # skip_data: the sampler went on from where step 4 left it (4 batches), then drew steps 3-5 again: 7
    # batches drawn (without skip_data it would be back at 2, drawing 3 and 4's prompts again: 5)
    assert ts["loader"]["step"] == 7
    text = logs(proc, out)
    assert "rollback guard: rollback 1 of at most 1: step 4 ->" in text

    bad = tmp_path / "bad"
    with injected(regression_at_steps=[3]):
        proc, _ = run_here("configs/demo_rl.yaml", bad, *tiny(assets, f"data.train_files=[{assets}/data/train.parquet]",
                                                             "data.val_files=[]", *guard, "trainer.total_steps=3",
                                                             "trainer.rollback.max_rollbacks=0"))
    assert proc.returncode != 0
    text = logs(proc, bad)
    assert "reward/score/mean dropped at step 3" in text and "max_rollbacks=0" in text, text[-3000:]
