"""The trainer learns on the synthetic task: a short SFT warm start (noisy labels), then GRPO with 2
local ranks (training tp=2, and dp=2) and PPO with a critic (GAE) on 1 rank. "Learns": the mean
training reward of the last steps beats that of the first steps by a clear margin."""
import pytest

from trn_helpers import data_overrides, logs, make_assets, metrics, run_job, warm_start

pytestmark = pytest.mark.dist
MARGIN = 0.05  # reward is a 0/1 accuracy under sampling; runs measured here rise by 0.1-0.2


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    root = make_assets(tmp_path_factory.getbasetemp() / "trn_assets")
    warm_start(root)  # root/sft/hf
    return root


def rises(out, k=10):
    r = [m["reward/score/mean"] for m in metrics(out) if "reward/score/mean" in m]
    first, last = sum(r[:k]) / k, sum(r[-k:]) / k
    return last - first, first, last


def rl(warm, out, *extra, ranks=1):
    proc, summary = run_job("configs/demo_rl.yaml", out, f"model.path={warm}/sft/hf", *data_overrides(warm),
                            "trainer.val_every=0", "actor.optim.lr=1e-3", "actor.optim.lr_decay_style=constant",
                            "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", *extra,
                            ranks=ranks, timeout=500)
    assert proc.returncode == 0, logs(proc, out)
    return summary


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=1"]], ids=["tp2", "dp2"])
def test_trn_grpo_two_ranks_learns(warm, tmp_path, layout):
    rl(warm, tmp_path / "out", "trainer.total_steps=60", "slurm.cpus_per_task=1", *layout, ranks=2)
    gain, first, last = rises(tmp_path / "out")
    assert gain > MARGIN, (first, last)


def test_trn_ppo_with_critic_learns(warm, tmp_path):
    rl(warm, tmp_path / "out", "algorithm.recipe=ppo", "rollout.n=1", "data.train_batch_size=64",
       "actor.ppo_mini_batch_size=32", "critic.ppo_mini_batch_size=32", "critic.micro_batch_size=32",
       "actor.micro_batch_size=32", "critic.optim.lr=1e-3", "trainer.total_steps=60")
    rows = metrics(tmp_path / "out")
    assert any("critic/vf_loss" in m for m in rows)
    gain, first, last = rises(tmp_path / "out")
    assert gain > MARGIN, (first, last)


def test_trn_dapo_refills_the_batch_with_informative_groups(warm, tmp_path):
    """DAPO's dynamic sampling on the warm model (its groups are mixed: some all right or all
    wrong, some not): rounds of 8 prompts are generated until 8 groups with differing rewards
    are kept, and exactly those 8 groups (32 samples) are trained on."""
    rl(warm, tmp_path / "out", "algorithm.recipe=dapo", "algorithm.overlong_buffer.enable=false",
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
