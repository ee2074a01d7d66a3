"""AsyncSaver: the caller is held only for the snapshot, the result equals a synchronous save bit for
bit, later changes to the tensors do not leak in, and errors surface on the next call."""
import threading

import pytest
import torch

from verl_hpc.checkpoint import AsyncSaver, CheckpointError, ShardedTensor, open_checkpoint, save_checkpoint
from verl_hpc.checkpoint import save as save_module


def tensors(full):
    return [ShardedTensor("a", full("a", (256, 300))), ShardedTensor("b", full("b", (77,), torch.bfloat16)),
            ShardedTensor("c", full("c", (3, 5), torch.int64))]


def assert_same_checkpoint(p, q, bitwise):
    with open_checkpoint(p) as x, open_checkpoint(q) as y:
        assert x.tensors().keys() == y.tensors().keys()
        for name in x.tensors():
            bitwise(x.load_tensor(name), y.load_tensor(name), name)
        assert x.metadata == y.metadata
        assert x.rank_state(0).keys() == y.rank_state(0).keys()
        for k, v in x.rank_state(0).items():
            assert (v == y.rank_state(0)[k]) if isinstance(v, bytes) else (v == y.rank_state(0)[k]).all()


def test_async_equals_sync_and_blocks_only_for_the_snapshot(tmp_path, full, bitwise, monkeypatch):
    ts = tensors(full)
    meta, state = {"trainer_state": {"history": [1.0, 2.0]}}, {"rng": torch.get_rng_state().numpy(), "b": b"x"}
    sync = save_checkpoint(tmp_path / "sync", 5, ts, metadata=meta, rank_state=state)

    release, writing = threading.Event(), threading.Event()
    real_write = save_module.write_rank_file

    def held_write(*a, **k):  # the background writer waits until the test lets it go
        writing.set()
        assert release.wait(30)
        return real_write(*a, **k)

    monkeypatch.setattr(save_module, "write_rank_file", held_write)
    saver = AsyncSaver(tmp_path / "async", timeout_s=60)
    originals = [t.local.clone() for t in ts]
    saver.save(5, ts, metadata=meta, rank_state=state)
    # save() has returned although the file cannot have been written yet
    assert writing.wait(30) and saver.busy
    assert not (tmp_path / "async" / "latest").exists()
    # the trainer goes on: updates weights in place and appends to its history
    for t in ts:
        t.local.add_(1) if t.local.dtype != torch.int64 else t.local.mul_(3)
    meta["trainer_state"]["history"].append(3.0)
    release.set()
    path = saver.wait()
    assert not saver.busy and path == tmp_path / "async" / "step_000005"
    for t, o in zip(ts, originals):
        t.local.copy_(o)
    assert_same_checkpoint(sync, path, bitwise)


def test_the_next_save_waits_and_reuses_snapshot_buffers(tmp_path, full):
    ts = tensors(full)
    with AsyncSaver(tmp_path, keep_last=2, timeout_s=60) as saver:
        for step in range(3):
            saver.save(step, ts)
            assert saver.last_blocked_s < 30
        bufs = dict(saver._buffers)
        saver.save(3, ts)
        assert all(saver._buffers[k] is v for k, v in bufs.items())  # no new allocation
    assert (tmp_path / "latest").read_text() == "step_000003\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]


def test_errors_surface_on_the_next_call(tmp_path, full, caplog):
    saver = AsyncSaver(tmp_path, timeout_s=60)
    saver.save(1, tensors(full), metadata={"bad": object()})  # not JSON-able: fails in the background
    with pytest.raises(CheckpointError, match="async checkpoint save of step 1 failed.*not JSON serializable"):
        saver.wait()
    assert "async checkpoint save of step 1 failed" in caplog.text  # logged when it happened, too
    saver.save(2, tensors(full))
    saver.save(3, tensors(full))  # waits for 2 first
    assert saver.wait() == tmp_path / "step_000003"


def test_async_across_simulated_ranks(tmp_path, ranks, full, bitwise):
    def rank(r, comm):
        t = ShardedTensor.chunk("w", full("w", (8, 6)).chunk(2, 1)[r].contiguous(), 1, r, 2)
        saver = AsyncSaver(tmp_path, group=comm, timeout_s=60)
        saver.save(1, [t])
        return saver.wait()

    assert ranks(2, rank)[0] == tmp_path / "step_000001"
    with open_checkpoint(tmp_path) as c:
        bitwise(c.load_tensor("w"), full("w", (8, 6)))


def test_the_savers_own_gloo_group_takes_the_jobs_collective_timeout(tmp_path, one_rank_world, monkeypatch):
    """A new group does not inherit the default group's timeout (torch gives gloo 30 minutes): the
    saver's group is built with the one it is given (issue 27, 7), the trainer's
    trainer.collective_timeout_s."""
    import datetime

    import torch.distributed as dist

    from verl_hpc.config import load_config
    from verl_hpc.trainer.programs.base import make_checkpointer

    made, real = [], dist.new_group

    def new_group(*a, **k):
        made.append(k.get("timeout"))
        return real(*a, **k)

    monkeypatch.setattr(dist, "new_group", new_group)
    AsyncSaver(tmp_path / "a", timeout_s=42).close()
    cfg = load_config(None, [f"checkpoint.dir={tmp_path}/b", "checkpoint.async_save=true",
                             "trainer.collective_timeout_s=77"])
    ctx = type("Ctx", (), {"world_size": 1})()
    make_checkpointer(cfg, ctx, engines={}, states={}, fmt="test", total_steps=1)._async.close()
    assert made == [datetime.timedelta(seconds=42), datetime.timedelta(seconds=77)]
