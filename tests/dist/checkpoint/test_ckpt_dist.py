"""Checkpoints across real gloo ranks (processes brought up by verl_hpc.runtime.bootstrap):

- 4 ranks save a TP2xPP2 layout (row/column splits, TP-replicated norms, flat optimizer shards);
  it loads exactly here at 1 rank and at 2 reader ranks with a split no writer had (loading is
  local, so ranks 0 and 1 of the same job play the 2-rank layout: one launch instead of two, the
  expensive part here); every rank's state round-trips; an AsyncSaver on its own gloo group
  writes the same bits as the synchronous save.
- kill -9 of both writers in the middle of a save leaves `latest` and the previous checkpoint intact.
"""
import signal
import time

import pytest
import torch

from ckpt_ranks import full_tensor, launch, start
from verl_hpc.checkpoint import (CheckpointReader, ShardedTensor, find_latest, open_checkpoint, read_rank_state,
                                 restore_rng_state, save_checkpoint)

pytestmark = pytest.mark.no_vllm("checkpoint save/load across ranks: no rollout")


def bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def test_tp2pp2_save_then_load_at_1_and_at_2_ranks(tmp_path):
    root, root_async = tmp_path / "ckpt", tmp_path / "ckpt_async"
    saved = launch(4, "save", dict(root=str(root), root_async=str(root_async)), tmp_path / "save")
    assert {r["path"] for r in saved} == {str(root / "step_000001")}
    print("4-rank sync save %.3f s; async save held the caller %.4f s" % (
        max(r["sync_s"] for r in saved), max(r["async_blocked_s"] for r in saved)))

    with open_checkpoint(root) as ckpt, open_checkpoint(root_async) as other:
        assert ckpt.world_size == 4 and ckpt.layout["tp"] == 2 and ckpt.metadata["trainer_state"] == {"step": 1}
        infos = ckpt.tensors()
        assert len(infos) == 3 + 5 * 4 + 4 + 1
        assert len(infos["decoder.layers.1.mlp.linear_fc2.weight"].pieces) == 2
        assert len(infos["decoder.layers.1.input_layernorm.weight"].pieces) == 1  # TP replicas written once
        for name, info in infos.items():  # 1 rank: every tensor whole
            got = ckpt.load_tensor(name)
            want = torch.tensor(42) if name == "optim.step" else full_tensor(
                name, info.global_shape, str(info.dtype).removeprefix("torch."))
            assert torch.equal(bits(got), bits(want)), name
            assert torch.equal(bits(other.load_tensor(name)), bits(got)), f"async differs: {name}"
        assert ckpt.metadata == other.metadata

    for r in range(4):  # each writer's RNG state comes back and draws what it drew
        state = read_rank_state(root, r)
        assert state["tag"] == f"rank {r}".encode()
        restore_rng_state(state)
        assert torch.rand(3).tolist() == saved[r]["rng_after"]

    for r in saved[:2]:  # the 2-rank reader layout (ranks 0 and 1 after the save)
        assert r["loaded"]["bad"] == [] and r["loaded"]["n"] == len(infos)
        assert r["loaded"]["tags"] == [f"rank {i}" for i in range(4)]


def test_kill_9_during_a_save_leaves_latest_and_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    procs = start(2, "kill", dict(root=str(root)), tmp_path / "kill")
    try:
        deadline = time.time() + 180
        while not all((tmp_path / "kill" / f"writing{r}").exists() for r in range(2)):
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                [(tmp_path / "kill" / f"rank{r}.log").read_text()[-2000:] for r in range(2)]
            time.sleep(0.1)
        for p in procs:  # both ranks are inside their first big write of step 2
            p.send_signal(signal.SIGKILL)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2

    partial = [p for p in root.iterdir() if p.name.startswith("step_000002.tmp-")]
    assert len(partial) == 1 and sorted(f.name for f in partial[0].iterdir()) == ["rank_00000.h5", "rank_00001.h5"]
    assert not (root / "step_000002").exists()
    assert (root / "latest").read_text() == "step_000001\n"
    with CheckpointReader(root) as ckpt:
        assert ckpt.step == 1
        nbytes, errors = ckpt.verify()
        assert errors == []
        assert torch.equal(ckpt.load_tensor("w"), torch.cat([torch.zeros(4, 8), torch.ones(4, 8)]))

    # the next save (here: a 1-rank job resuming) removes the leftover and moves latest on
    save_checkpoint(root, 3, [ShardedTensor("w", torch.ones(2))])
    assert not partial[0].exists() and find_latest(root) == root / "step_000003"
