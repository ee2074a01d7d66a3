"""`python -m verl_hpc.checkpoint export`: where it may write, and which base a LoRA merge accepts.

A LoRA checkpoint is made by hand here (adapters on linear_proj of a tiny Llama, the record a
trainer writes), so each case is an in-process `main(argv)` call of a fraction of a second."""
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from verl_hpc.checkpoint import ShardedTensor, save_checkpoint
from verl_hpc.checkpoint.__main__ import main
from verl_hpc.checkpoint.base_model import base_fingerprint
from verl_hpc.checkpoint.comm import ThreadWorld
from verl_hpc.models.tiny import make_tiny_model

RANK, ALPHA, LAYERS = 4, 8.0, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A base model folder, a LoRA checkpoint trained on it, and a same-shape model it was not."""
    tmp = tmp_path_factory.mktemp("export")
    base = make_tiny_model(tmp / "base", "llama", layers=LAYERS, seed=0)
    other = make_tiny_model(tmp / "other", "llama", layers=LAYERS, seed=1, shards=2)
    g = torch.Generator().manual_seed(0)
    factors = {f"decoder.layers.{i}.self_attention.linear_proj.lora_{f}": torch.randn(shape, generator=g)
               for i in range(LAYERS) for f, shape in (("A", (RANK, 128)), ("B", (128, RANK)))}
    lora = {"rank": RANK, "alpha": ALPHA, "targets": ["linear_proj"], "base_path": str(base),
            "base_fingerprint": base_fingerprint(str(base))}
    config = yaml.safe_dump({"model": {"path": str(base)}})

    save_checkpoint(tmp / "ckpt", 3, [ShardedTensor(f"actor/model/{n}", t) for n, t in factors.items()],
                    metadata={"config": config, "trainer_state": {"engines": {"actor": {"lora": lora}}}},
                    group=ThreadWorld(1).comm(0))
    return dict(base=base, other=other, ckpt=tmp / "ckpt", factors=factors)


def export(capsys, *args):
    code = main(["export", *map(str, args)])
    out = capsys.readouterr()
    return code, out.err


def files(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_an_export_never_writes_into_the_base_its_adapters_need(run, capsys):
    before = files(run["base"])
    for extra in ((), ("--overwrite",)):
        code, err = export(capsys, run["ckpt"], "--hf", run["base"], *extra)
        assert code == 2 and err.count("\n") == 1, err
        assert err == (f"error: --hf: '{run['base']}' is the base model the checkpoint's adapters were trained on "
                       "(a resume needs it); an export never writes into a folder it reads from, even with "
                       "--overwrite; valid: another folder\n"), err
    code, err = export(capsys, run["ckpt"], "--peft", run["base"], "--overwrite")
    assert code == 2 and err.startswith(f"error: --peft: '{run['base']}' is the base model the checkpoint's"), err
    assert files(run["base"]) == before  # the checkpoint can still resume on it


def test_merge_into_a_folder_holding_another_model_needs_overwrite_and_leaves_only_the_new_one(run, tmp_path, capsys):
    target = tmp_path / "served"
    shutil.copytree(run["other"], target)  # two shards and an index of another model
    (target / "notes.txt").write_text("mine")
    code, err = export(capsys, run["ckpt"], "--hf", target)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --hf: '{target}' holds a model (config.json, model-00001-of-00002.safetensors, "
                          "model-00002-of-00002.safetensors, model.safetensors.index.json); "), err
    assert "--overwrite" in err
    code, err = export(capsys, run["ckpt"], "--hf", target, "--overwrite")
    assert code == 0, err
    names = sorted(f.name for f in target.iterdir())
    assert [n for n in names if "safetensors" in n] == ["model.safetensors"], names  # no stale shard or index
    assert "notes.txt" in names  # not a model file: left alone
    merged, base = load_file(target / "model.safetensors"), load_file(run["base"] / "model.safetensors")
    for i in range(LAYERS):
        a, b = (run["factors"][f"decoder.layers.{i}.self_attention.linear_proj.lora_{f}"] for f in "AB")
        name = f"model.layers.{i}.self_attn.o_proj.weight"
        torch.testing.assert_close(merged[name], base[name] + ALPHA / RANK * b @ a)
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_an_overwritten_sharded_export_leaves_no_stale_shard(run, tmp_path, capsys):
    target = tmp_path / "merged"
    assert export(capsys, run["ckpt"], "--hf", target, "--shard-gb", "0.0002")[0] == 0
    first = sorted(f.name for f in target.iterdir() if "safetensors" in f.name)
    assert "model.safetensors.index.json" in first and len(first) > 2, first
    assert export(capsys, run["ckpt"], "--hf", target, "--overwrite")[0] == 0
    assert sorted(f.name for f in target.iterdir() if "safetensors" in f.name) == ["model.safetensors"]


def test_a_base_the_adapters_were_not_trained_on_is_refused(run, tmp_path, capsys):
    code, err = export(capsys, run["ckpt"], "--hf", tmp_path / "merged", "--model", run["other"])
    assert code == 23 and err.count("\n") == 1, err  # CheckpointLayoutError, as at resume
    assert err.startswith(f"error: the checkpoint's adapters were trained on the base model at {run['base']}, "
                          f"whose files differ from --model = {run['other']} "), err
    assert not (tmp_path / "merged").exists()
    copy = tmp_path / "copy"  # the same base elsewhere (another machine's path): accepted
    shutil.copytree(run["base"], copy)
    assert export(capsys, run["ckpt"], "--hf", tmp_path / "merged", "--model", copy)[0] == 0


@pytest.mark.parametrize("where,words", [
    ("file", "'{out}' is a file, not a folder; valid: a new or empty folder"),
    ("under a file", "'{parent}' is a file, not a folder (needed to create '{out}')"),
    ("/proc", "cannot create '{out}': No such file or directory"),
    ("not empty", "'{out}' is not empty (x.txt); valid: a new or empty folder, or --overwrite"),
    ("the checkpoint", "'{out}' is inside the checkpoint "),
])
def test_each_bad_output_path_is_one_line_naming_the_option(run, tmp_path, capsys, where, words):
    out = {"file": tmp_path / "f", "under a file": tmp_path / "f" / "x", "/proc": "/proc/verl_hpc_export",
           "not empty": tmp_path / "d", "the checkpoint": run["ckpt"] / "step_000003" / "hf"}[where]
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("x")
    for option in ("--hf", "--peft"):
        code, err = export(capsys, run["ckpt"], option, out)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: {option}: " + words.format(out=out, parent=tmp_path / "f")), err


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_a_shard_size_that_is_no_positive_number_is_refused(run, tmp_path, capsys, value):
    code, err = export(capsys, run["ckpt"], "--hf", tmp_path / "m", "--shard-gb", value)
    assert code == 2 and err == f"error: --shard-gb: got {float(value)}; valid: a number of GB > 0 (the largest " \
                                "safetensors file the export writes; default 5)\n", err
    assert not (tmp_path / "m").exists()


def test_hf_and_peft_into_one_folder_are_refused_before_either_is_written(run, tmp_path, capsys):
    code, err = export(capsys, run["ckpt"], "--hf", tmp_path / "x", "--peft", tmp_path / "x")
    assert code == 2 and "--hf and --peft both name" in err, err
    code, err = export(capsys, run["ckpt"], "--peft", tmp_path / "a", "--hf", run["base"])
    assert code == 2 and not (tmp_path / "a").exists(), err
    code, err = export(capsys, run["ckpt"], "--peft", tmp_path / "a", "--hf", tmp_path / "b")
    assert code == 0, err
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["r"] == RANK
    assert np.isfinite(load_file(tmp_path / "b" / "model.safetensors")["model.norm.weight"].numpy()).all()
