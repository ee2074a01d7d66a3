"""The commit protocol in one process: crashes at each step leave `latest` on a complete
checkpoint; leftovers are cleaned by the next save; retention keeps k and latest's target.
(kill -9 of real writer processes: tests/dist/checkpoint/test_ckpt_dist.py)"""
import os
import time

import pytest
import torch

from verl_hpc.checkpoint import (CheckpointError, CheckpointNotFoundError, ShardedTensor, apply_retention,
                                 checkpoint_step, find_latest, list_checkpoints, load_tensor, save_checkpoint)
from verl_hpc.checkpoint import publish, rankfile


def save(root, step, **kw):
    return save_checkpoint(root, step, [ShardedTensor("w", torch.full((4,), float(step)))], **kw)


def test_latest_names_the_newest_commit(tmp_path):
    assert find_latest(tmp_path) is None  # nothing committed yet: a fresh start
    save(tmp_path, 1)
    p = save(tmp_path, 2)
    assert (tmp_path / "latest").read_text() == "step_000002\n"
    assert find_latest(tmp_path) == p and checkpoint_step(tmp_path) == 2
    assert load_tensor(tmp_path, "w")[0].item() == 2.0
    assert not [q for q in tmp_path.iterdir() if ".tmp-" in q.name]


def test_crash_while_writing_a_file_leaves_latest_and_is_cleaned_next_time(tmp_path, monkeypatch):
    save(tmp_path, 1)

    def crash(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rankfile.os, "pwrite", crash)
    with pytest.raises(CheckpointError, match="rank 0: OSError: .*No space left on device"):
        save_checkpoint(tmp_path, 2, [ShardedTensor("w", torch.zeros(1 << 16))])
    monkeypatch.undo()
    leftovers = [q for q in tmp_path.iterdir() if ".tmp-" in q.name]
    assert len(leftovers) == 1 and leftovers[0].name.startswith("step_000002.tmp-")
    assert checkpoint_step(tmp_path) == 1 and load_tensor(tmp_path, "w")[0].item() == 1.0

    past = time.time() - 60
    os.utime(leftovers[0], (past, past))
    save(tmp_path, 3)
    assert not leftovers[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000003"]


def test_crash_between_rename_and_latest_keeps_the_previous_latest(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real = publish.atomic_write_text

    def dies_before_replace(path, text, token):
        if path.name == "latest":
            (path.with_name(f"latest.tmp-{token}")).write_text(text[:3])  # torn temp, never renamed
            raise KeyboardInterrupt("killed")
        real(path, text, token)

    monkeypatch.setattr(publish, "atomic_write_text", dies_before_replace)
    with pytest.raises(BaseException):
        save(tmp_path, 2)
    assert (tmp_path / "latest").read_text() == "step_000001\n"
    assert checkpoint_step(tmp_path) == 1                       # resume picks the old one ...
    assert checkpoint_step(tmp_path / "step_000002") == 2       # ... the new one is complete but uncommitted


def test_a_step_is_saved_once(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="step_000001 already exists"):
        save(tmp_path, 1)
    assert checkpoint_step(tmp_path) == 1


def test_retention_keeps_the_last_k_and_latest(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep_last=2)
        time.sleep(0.01)  # distinct commit times
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]

    # latest pointed back at an older checkpoint (a rollback): retention never removes it
    (tmp_path / "latest").write_text("step_000004\n")
    save(tmp_path, 6, keep_last=1)  # latest now names step 6 again
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000006"]
    (tmp_path / "latest").write_text("step_000006\n")
    save(tmp_path, 7)
    (tmp_path / "latest").write_text("step_000006\n")
    assert apply_retention(tmp_path, 1, "t") == []  # 7 is newest, 6 is latest's target
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000006", "step_000007"]


def test_keep_last_zero_keeps_all(tmp_path):
    for step in range(3):
        save(tmp_path, step, keep_last=0)
    assert len(list_checkpoints(tmp_path)) == 3


def test_latest_pointing_at_nothing_is_an_error(tmp_path):
    save(tmp_path, 1)
    (tmp_path / "latest").write_text("step_000009\n")
    with pytest.raises(CheckpointNotFoundError, match="points to 'step_000009', which is missing"):
        find_latest(tmp_path)
