"""GRPO learns through the user's command line (`python -m verl_hpc.submit --local`) on 2 local
ranks at training TP2 with the in-process vLLM rollout, from the shared SFT warm start (noisy
labels): the mean training reward of the last steps beats that of the first steps by a clear
margin. (DP layouts train the same weights as one process, tests/dist/engines/test_eng_parity.py,
so one layout's learning run stands for them; PPO and DAPO learn in tests/jobs/test_learning.py.)

In `make test-long`, not `make test`: a 60-step soak run. `make test` keeps what it rests on: a GRPO
step at training TP2 equals TP1's (tests/dist/trainer/test_trn_multi_turn.py, and DPO's in
test_trn_dpo.py), and every recipe's three-step job (tests/jobs/test_recipes.py)."""
import pytest

from jobs import data_overrides, logs, metrics, run_job

MARGIN = 0.05  # reward is a 0/1 accuracy under sampling; runs measured here rise by 0.1-0.2


@pytest.mark.long  # a soak run: 60 GRPO steps until the reward rises (make test-long; 75 s in make test's company)
def test_trn_grpo_two_ranks_tp2_learns(warm_assets, tmp_path):
    out = tmp_path / "out"
    proc, _ = run_job("configs/demo_rl.yaml", out, f"model.path={warm_assets}/sft/hf", *data_overrides(warm_assets),
                      "trainer.val_every=0", "actor.optim.lr=1e-3", "actor.optim.lr_decay_style=constant",
                      "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "trainer.total_steps=60",
                      "slurm.cpus_per_task=1", "parallel.tp=2", ranks=2, timeout=500)
    assert proc.returncode == 0, logs(proc, out)
    r = [m["reward/score/mean"] for m in metrics(out) if "reward/score/mean" in m]
    first, last = sum(r[:10]) / 10, sum(r[-10:]) / 10
    assert last - first > MARGIN, (first, last)
