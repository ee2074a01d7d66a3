"""PRIME jobs (1 rank, in this process, from the SFT warm start so that a group holds right and
wrong answers): a run with the implicit PRM -- a warm-up step in which only the PRM trains, then
both -- resumes bitwise through a checkpoint that holds the PRM's weights and Adam state beside the
actor's, and reports the PRM's metrics and the accuracy filter's share."""
import math

import pytest
import torch

from jobs import MOVING, grpo, logs, read_all, stable_metrics, straight_and_resumed

PRIME = ["algorithm.recipe=prime", "rollout.n=4", "prm.optim.lr=1e-3", "prm.ppo_mini_batch_size=2",
         "prm.micro_batch_size=8", "prm.warmup_steps=1", "algorithm.max_num_gen_batches=2"]


@pytest.fixture(scope="module")
def resumed(warm_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prime_job")
    common = [f"model.path={warm_assets}/sft/hf", *MOVING, *PRIME, "trainer.total_steps=3"]
    straight, split, proc = straight_and_resumed(lambda out, *extra: grpo(warm_assets, out, *common, *extra), tmp)
    return straight, split, logs(proc, split)


def test_prime_resume_is_bitwise_with_the_prm_in_the_checkpoint(resumed):
    straight, split, log = resumed
    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    assert any(n.startswith("prm/model/") for n in a) and any(n.startswith("prm/optim/exp_avg/") for n in a)
    first = read_all(split / "checkpoints" / "step_000001")
    prm = [n for n in a if n.startswith("prm/model/")]
    assert any(not torch.equal(first[n], a[n]) for n in prm), "the PRM never moved"
    # sync/*: the straight run's warm-up step left the actor as it was, so its step 2 needs no weight
    # sync, while a resumed run always syncs before its first generation
    no_sync = lambda rows: [{k: v for k, v in r.items() if not k.startswith("sync/")} for r in rows]  # noqa: E731
    ma, mb = no_sync(stable_metrics(straight)), no_sync(stable_metrics(split))
    assert ma == mb
    assert "roles: actor, ref, prm" in log


def test_prime_metrics_warmup_then_both_train(resumed):
    straight, _, _ = resumed
    rows = [r for r in stable_metrics(straight) if r.get("step", 0) >= 1]
    assert len(rows) == 3
    warm, trained = rows[0], [r for r in rows[1:] if not r.get("filter/empty_step")]
    assert warm["prm/warmup"] == 1.0 and "prm/ce_loss" in warm and "actor/pg_loss" not in warm
    assert trained, "every step after the warm-up was filtered empty"
    for r in [warm, *trained]:
        assert 0.0 <= r["prm/acc"] <= 1.0 and 0.0 <= r["filter/acc_filtered_share"] <= 1.0
        assert r["prm/nonfinite_steps"] == 0 and math.isfinite(r["prm/token_reward_std"])
    for r in trained:
        assert "actor/pg_loss" in r and "prm/warmup" not in r
        assert r["prm/token_reward_std"] > 0, "the PRM moved off the reference: process rewards are not all 0"
