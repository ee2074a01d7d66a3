"""GRPO over episodes (multi_turn) through the real engines: one step at training TP2 gives the TP1
weights within the engine's parity tolerance, and the episodes (turns, environment tokens, per-turn
rewards) are the same in both layouts. The environment (agent_env.py) answers every first turn, so
each episode holds environment tokens under loss mask 0 whatever the random model writes.

lr 1e-4 for the reason tests/dist/trainer/test_trn_dpo.py gives (Adam's first step amplifies
float-rounding differences of near-zero gradients at larger rates)."""
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from jobs import REPO, data_overrides, logs, metrics, run_here, run_job

TESTS = Path(__file__).resolve().parents[2]  # agent_env.py
TOLERANCE = 1e-5  # the engine's layout parity bound after one Adam step at lr 1e-4 (test_trn_dpo.py)


def args(assets):
    return [f"model.path={assets}/model", *data_overrides(assets), "multi_turn.enable=true",
            "multi_turn.environment=agent_env:OneMoreTurn", "safety.allow_custom_code=true",
            "multi_turn.max_turns=3", "data.max_response_length=64", "rollout.max_tokens=8",
            "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
            "trainer.total_steps=1", "trainer.val_every=0", "slurm.cpus_per_task=1", "actor.optim.lr=1e-4",
            "checkpoint.save_every=1", "tracking.backends=[jsonl]", "tracking.plots=false"]


def exported(out: Path, dest: Path):
    """`python -m verl_hpc.checkpoint export CKPT --hf DEST`'s main, in this process (its command line
    is tests/dist/checkpoint/test_ckpt_trainer_layouts.py's)."""
    from verl_hpc.checkpoint.__main__ import main

    assert main(["export", str(out / "checkpoints"), "--hf", str(dest)]) == 0
    return load_file(str(dest / "model.safetensors"))


@pytest.mark.long  # two launches, TP1 and TP2 (make test-long); make test covers episodes through the
# real engines in tests/jobs/test_agent_job.py and tests/unit/rollout/test_episodes.py, and a TP2 step
# equal to TP1 in tests/dist/trainer/test_trn_dpo.py and the engines' parity tests
def test_trn_grpo_episodes_tp2_equal_tp1(tiny_assets, tmp_path):
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    proc, _ = run_here("configs/demo_rl.yaml", one, *args(tiny_assets))
    assert proc.returncode == 0, logs(proc, one)
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{TESTS}")
    proc, _ = run_job("configs/demo_rl.yaml", two, *args(tiny_assets), "parallel.tp=2", ranks=2, timeout=600, env=env)
    assert proc.returncode == 0, logs(proc, two)
    m1, m2 = metrics(one)[-1], metrics(two)[-1]
    # the same episodes: two model turns each, environment tokens between, the per-turn reward counted
    assert m1["episode/turns_mean"] == m2["episode/turns_mean"] == 2.0
    assert m1["episode/model_token_share"] == m2["episode/model_token_share"] < 1.0
    assert m1["reward/score/mean"] == m2["reward/score/mean"]
    w1, w2 = exported(one, tmp_path / "hf1"), exported(two, tmp_path / "hf2")
    assert w1.keys() == w2.keys()
    worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert worst <= TOLERANCE, worst
    moved = max(float((w1[k] - load_file(str(tiny_assets / "model" / "model.safetensors"))[k]).abs().max()) for k in w1)
    assert moved > 10 * TOLERANCE, moved  # the step trained: equal weights are not the untouched start
