"""Exact resume (issue 7): 6 GRPO steps straight vs 3 steps (saved asynchronously), stop, resume
from `latest`, 3 more.
The final checkpoints (weights, Adam moments, step counts) must be bitwise equal and every per-step
metric equal. 1 rank, tiny model, HF rollout seeded per step. The tiny model never answers right,
so the rewards (and GRPO advantages) are all zero: an entropy bonus makes the updates non-zero."""
import json
import re

import pytest
import torch

from jobs import MOVING, grpo, logs, metrics, read_all, stable_metrics


@pytest.fixture
def assets(tiny_assets):
    return tiny_assets


def test_ckpt_trainer_resume_is_exact(assets, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    proc, s = grpo(assets, straight, "trainer.total_steps=6", *MOVING)
    assert proc.returncode == 0, logs(proc, straight)
    # "stop" after 3: the same job with total_steps=3 (constant LR: the schedule does not depend on
    # it), saving every step asynchronously: the resume below starts from an async-written checkpoint
    proc, s1 = grpo(assets, split, "trainer.total_steps=3", "checkpoint.async_save=true",
                    "checkpoint.save_every=1", *MOVING)
    assert proc.returncode == 0, logs(proc, split)
    assert s1["steps"] == 3 and (split / "checkpoints" / "latest").read_text().strip() == "step_000003"
    async_steps = re.findall(r"checkpoint: step (\d+) -> \S+ \(async, blocked", logs(proc, split))
    assert set(async_steps) == {"1", "2", "3"}, async_steps
    proc, s2 = grpo(assets, split, "trainer.total_steps=6", *MOVING)
    assert proc.returncode == 0, logs(proc, split)
    assert s2["resumed_from"] == 3 and s2["steps"] == 6, s2
    assert "continuing at step 4" in logs(proc, split)

    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b) and any(n.startswith("actor/optim/exp_avg/") for n in a)
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, f"not bitwise equal after resume: {differ[:5]}"
    first = read_all(split / "checkpoints" / "step_000003")
    assert any(not torch.equal(first[n], a[n]) for n in a if n.startswith("actor/model/")), "weights never moved"

    ma, mb = stable_metrics(straight), stable_metrics(split)
    assert [m["step"] for m in mb] == [1, 2, 3, 4, 5, 6], [m["step"] for m in mb]
    assert ma == mb, next((x, y) for x, y in zip(ma, mb) if x != y)

    from verl_hpc.checkpoint import read_metadata

    ts = read_metadata(split / "checkpoints")["trainer_state"]
    assert ts["step"] == 6 and ts["loader"]["step"] == 6 and "scheduler" in ts["engines"]["actor"]
    assert json.loads(json.dumps(ts)) == ts  # plain JSON, nothing pickled


def test_ckpt_trainer_resume_never_and_path(assets, tmp_path):
    out = tmp_path / "out"
    proc, _ = grpo(assets, out, "trainer.total_steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=0")
    assert proc.returncode == 0, logs(proc, out)
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step_000001", "step_000002"], ckpts
    # a fresh run into the same checkpoint.dir would save step 1 and 2 again: refused at the start
    proc, _ = grpo(assets, out, "trainer.total_steps=2", "trainer.resume=never")
    assert proc.returncode != 0
    assert "already holds step_000001, step_000002 from an earlier run" in logs(proc, out)
    # into a new output directory: the metric history comes from the checkpoint
    moved = tmp_path / "moved"
    proc, s = grpo(assets, moved, "trainer.total_steps=3",
                   f"checkpoint.dir={tmp_path}/moved_ckpt", f"trainer.resume={out}/checkpoints/step_000002")
    assert proc.returncode == 0, logs(proc, moved)
    assert s["resumed_from"] == 2 and [m["step"] for m in metrics(moved)] == [1, 2, 3]
    assert metrics(moved)[:2] == metrics(out)[:2]  # the saving run's rows, as written
    # an explicit path resumes from that checkpoint, even when `latest` is later
    proc, s = grpo(assets, out, "trainer.total_steps=3", f"trainer.resume={out}/checkpoints/step_000001",
                   "checkpoint.dir=" + str(tmp_path / "other"))
    assert proc.returncode == 0, logs(proc, out)
    assert s["resumed_from"] == 1 and s["steps"] == 3


# multi_turn: episodes of two model turns with environment tokens between (tests/agent_env.py)
EPISODES = ["multi_turn.enable=true", "multi_turn.environment=agent_env:OneMoreTurn", "safety.allow_custom_code=true",
            "data.max_response_length=64", "rollout.max_tokens=8"]


def test_ckpt_trainer_resume_with_episodes_is_exact(assets, tmp_path):
    """4 GRPO steps over episodes straight vs 2, stop, resume, 2 more: bitwise the same checkpoint
    and the same per-step metrics, episode metrics included (the sync trainer's episodes live within
    a step, so the checkpoint needs nothing more than for single-turn samples)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    proc, _ = grpo(assets, straight, "trainer.total_steps=4", *MOVING, *EPISODES)
    assert proc.returncode == 0, logs(proc, straight)
    proc, _ = grpo(assets, split, "trainer.total_steps=2", "checkpoint.save_every=1", *MOVING, *EPISODES)
    assert proc.returncode == 0, logs(proc, split)
    proc, s = grpo(assets, split, "trainer.total_steps=4", *MOVING, *EPISODES)
    assert proc.returncode == 0 and s["resumed_from"] == 2, logs(proc, split)
    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    ma, mb = stable_metrics(straight), stable_metrics(split)
    assert ma == mb and all(m["episode/turns_mean"] == 2.0 for m in ma)
