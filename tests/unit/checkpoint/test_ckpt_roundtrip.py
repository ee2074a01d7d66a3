"""Round trips in one process: every dtype bit for bit, partial slabs, metadata, rank state, RNG."""
import math
import random

import numpy as np
import pytest
import torch

from verl_hpc.checkpoint import (CheckpointLayoutError, CheckpointNotFoundError, ShardedTensor, capture_rng_state,
                                 list_tensors, load_into, load_tensor, open_checkpoint, read_metadata,
                                 read_rank_state, restore_rng_state, save_checkpoint)
from verl_hpc.checkpoint import checksum, rankfile


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.float64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_bitwise_for_every_dtype(tmp_path, dtype, full, bitwise):
    big = full("big", (300, 257), dtype)       # > RAW_MIN for the wider dtypes: pwrite path
    small = full("small", (5, 3), dtype)       # written through h5py
    if dtype.is_floating_point:  # specials survive as bits: nan payloads, -0.0, inf
        big.view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")]).to(dtype)
    scalar = full("scalar", (), dtype)
    empty = torch.zeros(0, 7, dtype=dtype)
    tensors = [ShardedTensor("big", big), ShardedTensor("small", small), ShardedTensor("scalar", scalar),
               ShardedTensor("empty", empty)]
    save_checkpoint(tmp_path, 1, tensors)
    for t in tensors:
        bitwise(load_tensor(tmp_path, t.name), t.local, t.name)


def test_partial_reads_across_checksum_blocks(tmp_path, full, monkeypatch):
    monkeypatch.setattr(checksum, "BASE_BLOCK", 4096)  # many blocks in a small tensor
    monkeypatch.setattr(rankfile, "CHUNK", 3 * 4096)
    t = full("w", (97, 61, 3))
    save_checkpoint(tmp_path, 1, [ShardedTensor("w", t)])
    rng = random.Random(0)
    with open_checkpoint(tmp_path) as ckpt:
        for _ in range(40):
            lo = [rng.randrange(s) for s in t.shape]
            shape = [rng.randint(1, s - o) for s, o in zip(t.shape, lo)]
            got = ckpt.load_tensor("w", lo, shape)
            assert torch.equal(got, t[tuple(slice(o, o + n) for o, n in zip(lo, shape))])


def test_metadata_round_trip_and_listing(tmp_path):
    meta = {"config": "trainer:\n  total_steps: 10\n", "trainer_state": {
        "sampler": {"epoch": 2, "position": 1234}, "kl_coef": 0.0123456789,
        "history": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": float("nan")}],
        "lr_scheduler": {"last_epoch": 7, "base_lrs": [1e-6]}}}
    save_checkpoint(tmp_path, 7, [ShardedTensor("x", torch.ones(3))], metadata=meta, layout={"tp": 1})
    back = read_metadata(tmp_path)
    assert back["config"] == meta["config"]
    assert back["trainer_state"]["kl_coef"] == 0.0123456789
    assert math.isnan(back["trainer_state"]["history"][1]["loss"])
    assert back["trainer_state"]["sampler"] == {"epoch": 2, "position": 1234}
    info = list_tensors(tmp_path)["x"]
    assert info.global_shape == (3,) and info.dtype == torch.float32 and len(info.pieces) == 1
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.step == 7 and ckpt.layout == {"tp": 1} and ckpt.world_size == 1


def test_rank_state_round_trip_restores_the_rng_streams(tmp_path):
    gen = torch.Generator().manual_seed(5)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in the state
    state = capture_rng_state(generators={"trainer": gen})
    state["blob"] = b"\x00sampler\xff"
    state["counts"] = np.arange(6, dtype=np.int16).reshape(2, 3)
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(2),
                torch.rand(2, generator=gen))
    save_checkpoint(tmp_path, 1, [], rank_state=state)
    random.seed(99), np.random.seed(99), torch.manual_seed(99), gen.manual_seed(99)

    back = read_rank_state(tmp_path, 0)
    assert back["blob"] == b"\x00sampler\xff" and back["counts"].dtype == np.int16
    np.testing.assert_array_equal(back["counts"], state["counts"])
    restore_rng_state(back, generators={"trainer": gen})
    got = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(2),
           torch.rand(2, generator=gen))
    assert got[:4] == expected[:4]
    assert torch.equal(got[4], expected[4]) and torch.equal(got[5], expected[5])
    with pytest.raises(CheckpointNotFoundError, match="written by 1 ranks; no rank 3"):
        read_rank_state(tmp_path, 3)


def test_rank_state_refuses_objects(tmp_path):
    with pytest.raises(Exception, match="numeric numpy arrays or bytes only"):
        save_checkpoint(tmp_path, 1, [], rank_state={"sampler": {"pos": 3}})


def test_load_into_fills_in_place_and_checks_what_it_fills(tmp_path, full):
    w = full("w", (8, 6))
    save_checkpoint(tmp_path, 1, [ShardedTensor("w", w)])
    target = torch.zeros(4, 6)
    ptr = target.data_ptr()
    load_into(tmp_path, [ShardedTensor("w", target, (8, 6), (4, 0))])
    assert torch.equal(target, w[4:]) and target.data_ptr() == ptr
    strided = torch.zeros(6, 8).t()  # a non-contiguous target
    load_into(tmp_path, [ShardedTensor("w", strided)])
    assert torch.equal(strided, w)
    with pytest.raises(CheckpointLayoutError, match="float32.*wants.*bfloat16"):
        load_into(tmp_path, [ShardedTensor("w", torch.zeros(8, 6, dtype=torch.bfloat16))])
    with pytest.raises(CheckpointLayoutError, match=r"global shape \[8, 6\].*wants \[8, 7\]"):
        load_into(tmp_path, [ShardedTensor("w", torch.zeros(8, 7))])
    with pytest.raises(CheckpointNotFoundError, match=r"no tensor 'ww'.*did you mean \['w'\]"):
        load_tensor(tmp_path, "ww")


def test_bad_slabs_are_refused_with_the_tensor_named():
    with pytest.raises(CheckpointLayoutError, match="tensor 'w': slab offsets \\[2, 0\\] \\+ shape \\[3, 4\\] exceed"):
        ShardedTensor("w", torch.zeros(3, 4), (4, 4), (2, 0))
    with pytest.raises(CheckpointLayoutError, match="same number of dims"):
        ShardedTensor("w", torch.zeros(3, 4), (4,), (0,))
    st = ShardedTensor.chunk("fc2", torch.zeros(8, 3), dim=1, index=2, parts=4)
    assert st.global_shape == (8, 12) and st.offsets == (0, 6)


def test_long_saves_and_loads_log_their_rate(tmp_path, full, caplog, monkeypatch):
    monkeypatch.setattr(rankfile, "CHUNK", 1 << 20)  # several writes, each may log
    caplog.set_level("INFO", logger="verl_hpc.checkpoint")
    ts = [ShardedTensor(f"t{k}", full(f"t{k}", (512, 1024))) for k in range(2)]  # 2 x 2 MB
    save_checkpoint(tmp_path, 1, ts, progress_interval=0)
    saves = [r.message for r in caplog.records if r.message.startswith("checkpoint save step 1:")]
    assert saves and all("MB/s" in m for m in saves)
    assert any("checkpoint step 1 saved to" in r.message and "MB/s" in r.message for r in caplog.records)
    caplog.clear()
    with open_checkpoint(tmp_path) as ckpt:
        ckpt.progress_interval = 0
        ckpt.load_into([ShardedTensor(t.name, torch.empty_like(t.local)) for t in ts])
    assert any(r.message.startswith("checkpoint load step 1 (2 tensors):") and "MB/s" in r.message
               for r in caplog.records)


def test_checksum_is_zlibs_crc32_of_each_block():
    import zlib

    data = np.random.default_rng(0).integers(0, 256, size=(3 << 20) + 17, dtype=np.uint8)
    block = 1 << 20
    want = [zlib.crc32(data[i:i + block].tobytes()) for i in range(0, len(data), block)]
    assert checksum.block_crcs(data, block).tolist() == want  # whichever implementation is installed
    assert checksum.block_bytes_for(1) == checksum.block_bytes_for(16 << 30) == 4 << 20
    assert checksum.block_bytes_for((16 << 30) + 1) == 8 << 20


def test_megatron_tracker_states_round_trip(tmp_path, monkeypatch):
    """The named model-parallel RNG streams (dropout inside TP regions) resume where they were;
    a tracker state the checkpoint lacks is kept, and a process without a tracker is told."""
    import megatron.core.tensor_parallel.random as rnd

    from verl_hpc.parallel.cpu_compat import _tracker_class

    tracker = _tracker_class()()
    monkeypatch.setattr(rnd, "_CUDA_RNG_STATE_TRACKER", tracker)
    monkeypatch.setattr(rnd, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    tracker.add("model-parallel-rng", 123)
    with tracker.fork():
        torch.rand(3)  # somewhere along the stream
    state = capture_rng_state()
    assert state["megatron_tracker_model-parallel-rng"].dtype == np.uint8
    save_checkpoint(tmp_path, 1, [], rank_state=state)
    with tracker.fork():
        expected = torch.rand(4)
    tracker.add("expert-parallel-rng", 7)  # not in the checkpoint

    restore_rng_state(read_rank_state(tmp_path, 0))
    with tracker.fork():
        assert torch.equal(torch.rand(4), expected)
    assert set(tracker.get_states()) == {"model-parallel-rng", "expert-parallel-rng"}

    monkeypatch.setattr(rnd, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    assert not any(k.startswith("megatron_tracker_") for k in capture_rng_state())


@pytest.mark.gpu
def test_cuda_generator_round_trip(tmp_path):
    torch.cuda.init()
    torch.cuda.manual_seed(3)
    torch.rand(5, device="cuda")
    save_checkpoint(tmp_path, 1, [], rank_state=capture_rng_state())
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(99)
    restore_rng_state(read_rank_state(tmp_path, 0))
    assert torch.equal(torch.rand(4, device="cuda"), expected)
