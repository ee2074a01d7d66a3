"""Damage is found and named: flipped bytes, missing or truncated files, a torn or edited index,
missing datasets and pieces; inconsistent layouts are refused at save time on every rank."""
import json
import re
import shutil

import h5py
import pytest
import torch

from verl_hpc.checkpoint import (CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ShardedTensor,
                                 load_tensor, open_checkpoint, save_checkpoint)
from verl_hpc.checkpoint.index import INDEX, build_index, read_index


@pytest.fixture
def ckpt(tmp_path, full, ranks):
    """Two ranks (threads): 'big' (2 MB, raw-written) row-split, 'small' (h5py-written) on rank 1."""
    big = full("big", (512, 1024))

    def rank(r, comm):
        tensors = [ShardedTensor.chunk("big", big.chunk(2)[r].clone(), 0, r, 2)]
        if r == 1:
            tensors.append(ShardedTensor("small", full("small", (4, 4))))
        return save_checkpoint(tmp_path / "root", 1, tensors, group=comm)

    return ranks(2, rank)[0]


def flip_byte(path, dataset, at):
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + at)
        b = fh.read(1)
        fh.seek(offset + at)
        fh.write(bytes([b[0] ^ 0x10]))


def test_flipped_byte_names_tensor_file_and_dataset(ckpt, full):
    flip_byte(ckpt / "rank_00001.h5", "/tensors/big", 700_000)  # in block 0 of rank 1's piece
    with pytest.raises(CheckpointCorruptError) as e:
        load_tensor(ckpt, "big")
    msg = str(e.value)
    assert "tensor 'big'" in msg and "rank_00001.h5" in msg and "dataset /tensors/big" in msg, msg
    assert "checksum mismatch" in msg and "bytes [0, 1048576)" in msg
    # rank 0's half is untouched and still loads
    assert torch.equal(load_tensor(ckpt, "big", offsets=(0, 0), shape=(256, 1024)), full("big", (512, 1024))[:256])


def test_flipped_byte_in_a_small_dataset(ckpt):
    flip_byte(ckpt / "rank_00001.h5", "/tensors/small", 5)
    with pytest.raises(CheckpointCorruptError, match=r"tensor 'small' \(file .*rank_00001.h5, dataset /tensors/small"):
        load_tensor(ckpt, "small")


def test_missing_file_is_named(ckpt):
    (ckpt / "rank_00000.h5").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"tensor 'big': file .*rank_00000.h5 is missing"):
        load_tensor(ckpt, "big")
    assert load_tensor(ckpt, "small").shape == (4, 4)  # what lives elsewhere still loads


def test_truncated_file_is_named(ckpt):
    path = ckpt / "rank_00000.h5"
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    with pytest.raises(CheckpointCorruptError, match=r"rank_00000.h5 has \d+ bytes but the index recorded \d+"):
        load_tensor(ckpt, "big")


def test_torn_index(ckpt):
    text = (ckpt / INDEX).read_text()
    (ckpt / INDEX).write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointCorruptError, match="index.json is not valid JSON \\(torn or truncated write"):
        open_checkpoint(ckpt)


def test_edited_index_fails_its_checksum(ckpt):
    body = json.loads((ckpt / INDEX).read_text())
    body["tensors"]["big"]["pieces"][1]["offsets"] = [255, 0]
    (ckpt / INDEX).write_text(json.dumps(body))
    with pytest.raises(CheckpointCorruptError, match="fails its checksum"):
        open_checkpoint(ckpt)


def rewrite_index(ckpt, edit):
    body = read_index(ckpt)
    edit(body)
    keep = {k: body[k] for k in ("step", "world_size", "layout", "files", "tensors", "metadata")}
    (ckpt / INDEX).write_text(build_index(**keep))


def test_missing_piece_in_the_index(ckpt):
    rewrite_index(ckpt, lambda b: b["tensors"]["big"]["pieces"].pop(1))
    with pytest.raises(CheckpointNotFoundError, match="'big': the index's pieces cover 262144 of the 524288"):
        load_tensor(ckpt, "big")
    assert load_tensor(ckpt, "big", offsets=(0, 0), shape=(256, 1024)).shape == (256, 1024)


def test_missing_dataset_in_a_file(ckpt):
    with h5py.File(ckpt / "rank_00001.h5", "r+") as f:
        del f["/tensors/small"]
    rewrite_index(ckpt, lambda b: b["files"][1].update(bytes=(ckpt / "rank_00001.h5").stat().st_size))
    with pytest.raises(CheckpointNotFoundError,
                       match=r"'small': dataset /tensors/small missing from file .*rank_00001.h5"):
        load_tensor(ckpt, "small")


def test_index_and_file_must_agree(ckpt):
    with h5py.File(ckpt / "rank_00001.h5", "r+") as f:
        f["/tensors/big"].attrs["offsets"] = [0, 0]
    rewrite_index(ckpt, lambda b: b["files"][1].update(bytes=(ckpt / "rank_00001.h5").stat().st_size))
    with pytest.raises(CheckpointCorruptError, match="index and file disagree for dataset /tensors/big"):
        load_tensor(ckpt, "big")


def test_not_a_checkpoint(tmp_path, ckpt):
    with pytest.raises(CheckpointNotFoundError, match="expected a checkpoint directory"):
        open_checkpoint(tmp_path / "nothing")
    partial = ckpt.with_name(ckpt.name + ".tmp-123-abc")
    shutil.copytree(ckpt, partial)
    (partial / INDEX).unlink()
    with pytest.raises(CheckpointNotFoundError, match="is a save that never finished"):
        open_checkpoint(partial)


@pytest.mark.parametrize("case,pattern", [
    ("overlap", r"'w': slabs at offsets \[0, 0\] shape \[3, 4\] and offsets \[2, 0\] shape \[2, 4\] overlap"),
    ("gap", r"'w': the ranks' slabs cover 12 of its 16 elements"),
    ("dtype", r"'w': rank 0 says global_shape \[4, 4\] dtype float32, rank 1 says \[4, 4\] bfloat16"),
    ("prefix", r"'w' is both a tensor and a prefix"),
    ("name", r"bad tensor name 'a#1'"),
])
def test_inconsistent_layouts_fail_on_every_rank(tmp_path, case, pattern, ranks):
    def rank(r, comm):
        w = torch.zeros(4, 4)
        tensors = {
            "overlap": [ShardedTensor("w", w[:3], (4, 4), (0, 0)) if r == 0
                        else ShardedTensor("w", w[2:], (4, 4), (2, 0))],
            "gap": [ShardedTensor("w", w[:3], (4, 4), (0, 0))],
            "dtype": [ShardedTensor("w", w if r == 0 else w.bfloat16())],
            "prefix": [ShardedTensor("w", w), ShardedTensor("w/x", w)],
            "name": [ShardedTensor("a#1" if r else "a", w)],
        }[case]
        try:
            save_checkpoint(tmp_path, 1, tensors, group=comm)
        except CheckpointError as e:
            return str(e)
        return None

    errors = ranks(2, rank)
    assert errors[0] == errors[1] and errors[0] is not None
    assert re.search(pattern, errors[0]), errors[0]
    assert not (tmp_path / "latest").exists() and not list(tmp_path.glob("step_*[0-9]"))


def test_verify_reports_every_problem(ckpt):
    flip_byte(ckpt / "rank_00000.h5", "/tensors/big", 1_048_576 - 1)
    flip_byte(ckpt / "rank_00001.h5", "/tensors/small", 0)
    with open_checkpoint(ckpt) as c:
        nbytes, errors = c.verify()
    assert len(errors) == 2 and "rank_00000.h5" in errors[0] and "'small'" in errors[1], errors
