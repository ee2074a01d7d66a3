"""The trainer learns on the synthetic task, one rank in the test process (tests/jobs.py), from the
shared SFT warm start (noisy labels): PPO with a critic (GAE) raises the training reward, and DAPO's
dynamic sampling refills its batch with informative groups. "Learns": the mean training reward of
the last steps beats that of the first steps by a clear margin. GRPO on 2 ranks through the
command line with vLLM is tests/dist/trainer/test_trn_learning.py."""
import pytest

from jobs import data_overrides, logs, metrics, run_here

MARGIN = 0.05  # reward is a 0/1 accuracy under sampling; runs measured here rise by 0.1-0.2


def rises(out, k=10):
    r = [m["reward/score/mean"] for m in metrics(out) if "reward/score/mean" in m]
    first, last = sum(r[:k]) / k, sum(r[-k:]) / k
    return last - first, first, last


def rl(warm, out, *extra):
    proc, summary = run_here("configs/demo_rl.yaml", out, f"model.path={warm}/sft/hf", *data_overrides(warm),
                             "rollout.engine=hf", "trainer.val_every=0", "actor.optim.lr=1e-3",
                             "actor.optim.lr_decay_style=constant", "data.train_batch_size=16",
                             "actor.ppo_mini_batch_size=16", "tracking.plots=false", *extra)
    assert proc.returncode == 0, logs(proc, out)
    return summary


@pytest.mark.numerics
@pytest.mark.long  # a soak run: 60 PPO steps until the critic's run learns (make test-long; 126-262 s);
# PPO with a critic steps in `make test` too: test_recipes.py's three-step ppo jobs
def test_trn_ppo_with_critic_learns(warm_assets, tmp_path):
    rl(warm_assets, tmp_path / "out", "algorithm.recipe=ppo", "rollout.n=1", "data.train_batch_size=64",
       "actor.ppo_mini_batch_size=32", "critic.ppo_mini_batch_size=32", "critic.micro_batch_size=32",
       "actor.micro_batch_size=32", "critic.optim.lr=1e-3", "trainer.total_steps=60")
    rows = metrics(tmp_path / "out")
    assert any("critic/vf_loss" in m for m in rows)
    gain, first, last = rises(tmp_path / "out")
    assert gain > MARGIN, (first, last)


@pytest.mark.numerics
def test_trn_dapo_refills_the_batch_with_informative_groups(warm_assets, tmp_path):
    """DAPO's dynamic sampling on the warm model (its groups are mixed: some all right or all
    wrong, some not): rounds of 8 prompts are generated until 8 groups with differing rewards
    are kept, and exactly those 8 groups (32 samples) are trained on."""
    rl(warm_assets, tmp_path / "out", "algorithm.recipe=dapo", "algorithm.overlong_buffer.enable=false",
       "rollout.n=4", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
       "actor.micro_batch_size=16", "algorithm.max_num_gen_batches=8", "trainer.total_steps=4")
    rows = [m for m in metrics(tmp_path / "out") if m.get("step", 0) >= 1]
    assert len(rows) == 4
    for m in rows:
        assert 1 <= m["filter/gen_batches"] <= 8
        if m["filter/missing_groups"] == 0:
            assert m["filter/kept_groups"] == 8 and m["train/samples"] == 32, m
    print("generation rounds per step:", [m["filter/gen_batches"] for m in rows],
          "groups dropped:", [m["filter/dropped_groups"] for m in rows])
    assert any(m["filter/gen_batches"] > 1 for m in rows), "no step needed a second round"
