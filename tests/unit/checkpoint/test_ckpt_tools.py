"""Readable without this project: h5ls/h5dump list the tensors and their attributes, plain h5py reads
them (the recipe of docs/checkpoints.md); and the inspect/verify commands."""
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from verl_hpc.checkpoint import ShardedTensor, save_checkpoint

REPO = Path(__file__).resolve().parents[3]
ENV = dict(os.environ, HDF5_USE_FILE_LOCKING="FALSE", PYTHONPATH=str(REPO))
CONFIG = "trainer:\n  total_steps: 10\n  seed: 1\nparallel:\n  tp: 2\n  pp: 2\nmodel:\n  path: /models/x\n"


@pytest.fixture
def ckpt(tmp_path, full, ranks):
    def rank(r, comm):
        return save_checkpoint(tmp_path, 12, [
            ShardedTensor.chunk("decoder.layers.0.mlp.linear_fc1.weight",
                                full("fc1", (8, 4)).chunk(2)[r].clone(), 0, r, 2),
            ShardedTensor("decoder.final_layernorm.weight", full("ln", (4,), torch.bfloat16)),
        ], metadata={"config": CONFIG, "trainer_state": {"step": 12}}, layout={"tp": 2, "pp": 1, "dp": 1},
            rank_state={"seed": np.array([r])}, group=comm)
    return ranks(2, rank)[0]


def run(*args):
    return subprocess.run(list(args), capture_output=True, text=True, env=ENV, timeout=60, cwd=REPO)


def test_h5ls_lists_the_tensors(ckpt):
    r = run("h5ls", "-r", str(ckpt / "rank_00000.h5"))
    assert r.returncode == 0, r.stderr
    assert "/tensors/decoder.layers.0.mlp.linear_fc1.weight Dataset {4, 4}" in " ".join(r.stdout.split())
    assert "/tensors/decoder.final_layernorm.weight" in r.stdout and "/rank_state/seed" in r.stdout
    r1 = run("h5ls", "-r", str(ckpt / "rank_00001.h5"))  # rank 1 holds only its fc1 rows
    assert "linear_fc1.weight" in r1.stdout and "final_layernorm" not in r1.stdout


def test_h5dump_shows_the_attributes(ckpt):
    r = run("h5dump", "-A", "-H", str(ckpt / "rank_00001.h5"))
    assert r.returncode == 0, r.stderr
    for attr in ("name", "global_shape", "offsets", "dtype", "crc32", "crc32_block_bytes", "step", "rank"):
        assert f'ATTRIBUTE "{attr}"' in r.stdout, attr
    values = run("h5dump", "-a", "/tensors/decoder.layers.0.mlp.linear_fc1.weight/offsets",
                 str(ckpt / "rank_00001.h5")).stdout
    assert "(0): 4, 0" in values


def test_plain_h5py_reads_it_by_the_docs_recipe(ckpt, full, bitwise):
    index = json.loads((ckpt / "index.json").read_text())
    entry = index["tensors"]["decoder.final_layernorm.weight"]
    piece = entry["pieces"][0]
    with h5py.File(ckpt / piece["file"], "r", locking=False) as f:
        arr = f[piece["dataset"]][()]
        crc = f[piece["dataset"]].attrs["crc32"]
    assert entry["dtype"] == "bfloat16" and arr.dtype == np.uint16
    assert list(crc) == [zlib.crc32(arr.tobytes())]  # small dataset: one block, plain zlib checks it
    bitwise(torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16), full("ln", (4,), torch.bfloat16))
    fc1 = index["tensors"]["decoder.layers.0.mlp.linear_fc1.weight"]
    whole = np.zeros(fc1["global_shape"], np.float32)
    for p in fc1["pieces"]:
        with h5py.File(ckpt / p["file"], "r", locking=False) as f:
            whole[tuple(slice(o, o + n) for o, n in zip(p["offsets"], p["shape"]))] = f[p["dataset"]][()]
    assert np.array_equal(whole, full("fc1", (8, 4)).numpy())


def cli(capsys, *args):
    from verl_hpc.checkpoint.__main__ import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect(ckpt, capsys):
    code, out, _ = cli(capsys, "inspect", ckpt.parent)  # a root: follows latest
    assert code == 0
    assert "step 12" in out and "by 2 rank(s)" in out and '"tp": 2' in out
    assert "parallel: tp=2 pp=2" in out and "model: path=/models/x" in out
    line = next(x for x in out.splitlines() if "linear_fc1.weight" in x).split()
    assert line[1:] == ["float32", "[8,", "4]", "2"]
    line = next(x for x in out.splitlines() if "final_layernorm" in x).split()
    assert line[1:] == ["bfloat16", "[4]", "1"]
    code, out, _ = cli(capsys, "inspect", ckpt, "--json")
    j = json.loads(out)
    assert j["step"] == 12 and j["tensors"]["decoder.layers.0.mlp.linear_fc1.weight"]["pieces"] == 2


def test_verify_ok_damaged_and_missing(ckpt, tmp_path, capsys):
    code, out, _ = cli(capsys, "verify", ckpt)
    assert code == 0 and out.startswith("OK:") and "2 tensors in 3 pieces" in out, out
    with h5py.File(ckpt / "rank_00001.h5", "r") as f:
        offset = f["tensors/decoder.layers.0.mlp.linear_fc1.weight"].id.get_offset()
    with open(ckpt / "rank_00001.h5", "r+b") as fh:
        fh.seek(offset + 3)
        fh.write(b"\xff")
    code, out, _ = cli(capsys, "verify", ckpt)
    assert code == 22 and "DAMAGED" in out  # CheckpointCorruptError's code
    assert "'decoder.layers.0.mlp.linear_fc1.weight'" in out and "rank_00001.h5" in out, out
    code, _, err = cli(capsys, "verify", tmp_path / "nope")
    assert code == 21 and "error: no checkpoint at" in err  # CheckpointNotFoundError's code
    (ckpt / "index.json").write_text("{")
    code, out, err = cli(capsys, "verify", ckpt)
    assert code == 22 and not out and err.startswith(f"error: {ckpt / 'index.json'} is not valid JSON"), err


def test_verify_a_latest_of_binary_bytes_is_one_error_line(ckpt, capsys):
    (ckpt.parent / "latest").write_bytes(b"\xff\xfe\x00step")
    code, out, err = cli(capsys, "verify", ckpt.parent)
    assert code == 22 and not out, out
    assert err == (f"error: {ckpt.parent / 'latest'} is not text: byte 0 is b'\\xff', not UTF-8; expected one "
                   "line naming a checkpoint folder, e.g. 'step_000120'\n"), err
    (ckpt.parent / "latest").write_bytes(b"step\x00000012\n")  # UTF-8, but no folder name
    code, out, err = cli(capsys, "verify", ckpt.parent)
    assert code == 22 and err.count("\n") == 1 and "with a control character" in err, err


@pytest.mark.parametrize("damage,words", [
    ("truncate", "has 100 bytes but the index recorded"),
    ("overwrite the header", "cannot be opened as HDF5"),
])
def test_inspect_refuses_a_damaged_rank_file_without_reading_the_data(ckpt, capsys, damage, words):
    path = ckpt / "rank_00001.h5"
    if damage == "truncate":
        os.truncate(path, 100)
    else:
        with open(path, "r+b") as fh:
            fh.write(b"\0" * 512)  # the superblock: the size still agrees with the index
    for args in ((), ("--json",)):
        code, out, err = cli(capsys, "inspect", ckpt, *args)
        assert code == 22 and not out, out
        assert err.startswith(f"error: rank 1: file {path} {words}") and err.count("\n") == 1, err


@pytest.mark.heavy
def test_the_module_runs_as_a_command(ckpt):
    r = run(sys.executable, "-m", "verl_hpc.checkpoint", "inspect", str(ckpt))
    assert r.returncode == 0 and "decoder.final_layernorm.weight" in r.stdout, r.stderr


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli(capsys, "--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "inspect" in out and "verify" in out


def test_export_names_what_is_missing(ckpt, capsys):
    """No output named, or --peft of a checkpoint trained without LoRA: one error line each."""
    from verl_hpc.checkpoint.__main__ import main

    assert main(["export", str(ckpt)]) != 0
    assert "--hf OUT" in capsys.readouterr().err
    assert main(["export", str(ckpt), "--peft", str(ckpt.parent / "adapter")]) != 0
    err = capsys.readouterr().err
    assert "trained without LoRA" in err and "use --hf" in err
