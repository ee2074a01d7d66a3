"""On-policy distillation in split placement, for real: 1 rollout rank (vLLM) + 1 training rank
(Megatron, the actor and the frozen teacher side by side).

At k = 0 the split run is the colocated run with the same teacher, bitwise: the actor's weights and
every step's teacher/kl. The split run is also preempted after step 1 and resumed from its checkpoint
(the teacher rebuilt from its folder on the training rank, named in the checkpoint by fingerprint),
so the match covers a resume of a split job with a teacher as well.
"""
import json

import pytest
from faults import env
from jobs import data_overrides, read_all, run_here, run_job

SPLIT_DEMO = "configs/demo_rl_split.yaml"  # demo_rl.yaml + placement split, 1 rollout rank of 2


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 3-layer tiny model: another model than the 2-layer student, with every tiny model's tokenizer."""
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("teacher") / "model", "llama", layers=3, seed=1)


def common(root, teacher, steps):
    return [f"model.path={root}/model", *data_overrides(root), f"trainer.total_steps={steps}", "trainer.val_every=0",
            "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=16",
            "rollout.engine=vllm", "slurm.cpus_per_task=1", "actor.optim.lr=1e-3",
            "teacher.enable=true", f"teacher.model_path={teacher}", "teacher.coef=0.5"]


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.long  # a chain of launches: split and colocated runs, each across a resume (make test-long)
def test_split_with_a_teacher_is_the_colocated_run_bitwise_across_a_resume(tiny_assets, teacher, tmp_path):
    colo, split = tmp_path / "colocated", tmp_path / "split"
    p, _ = run_here("configs/demo_rl.yaml", colo, *common(tiny_assets, teacher, 3), "checkpoint.save_every=0")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # preempted after step 1 (the test faults: Slurm's warning signal), then resumed to step 3; the
    # same total_steps in both launches, so the learning-rate schedule is the straight run's
    for at, resumed in ((1, 0), (0, 1)):
        p, s = run_job(SPLIT_DEMO, split, *common(tiny_assets, teacher, 3), "async_training.staleness=0",
                       "checkpoint.save_every=0", ranks=2, env=env(warning_signal_at_step=at))
        # stopped by the warning signal: 128 + SIGUSR2's 12, with the submitter's line saying where
        assert p.returncode == (140 if at else 0), p.stdout[-3000:] + p.stderr[-3000:]
        assert not at or f"stopped early at step {at} of 3" in p.stdout + p.stderr, p.stdout[-3000:]
        assert (s["resumed_from"], s["steps"]) == (resumed, at or 3), s
    # the training rank (global rank 1; submit echoes rank 0's lines only) built the teacher
    logs = "".join(f.read_text() for f in (split / "logs").glob("*/*/attempt_*/1/stderr.log"))
    assert "roles: actor, teacher" in logs, logs[-3000:]
    a, b = read_all(colo / "checkpoints"), read_all(split / "checkpoints")
    actor = [n for n in a if n.startswith("actor/model/")]
    assert actor and not any(n.startswith("teacher") for n in b)  # frozen: never saved
    assert [n for n in actor if not (a[n] == b[n]).all()] == []
    moved = read_all(split / "checkpoints" / "step_000001")
    assert any(not (moved[n] == b[n]).all() for n in actor), "the weights never moved: the match is vacuous"
    kl = lambda out: [r["teacher/kl"] for r in rows(out) if "teacher/kl" in r]  # noqa: E731
    assert len(kl(colo)) == 3 and all(v != 0 for v in kl(colo))
    assert kl(split)[-3:] == kl(colo)  # metrics.jsonl of the split run holds both launches' steps
