"""A trainer checkpoint written at one parallel layout loads at another (issue 7), and its HF
export loads in transformers with the engine's logits.

Checkpoint A: a GRPO job at TP2xPP2 (4 ranks, 2 steps); checkpoint C: a GRPO job at TP1 (1 rank,
1 step). Then 4 gloo ranks (ckpt_layout_ranks.py):
  tp1 (DP4):  load C -> logits; load A -> logits; save the loaded A again as checkpoint B (at TP1)
  tp2pp2:     load A, C and B -> logits
A at TP1 equals A at TP2xPP2, and C at TP2xPP2 equals C at TP1 (both directions), to fp32
rounding (TP changes the summation order of row-parallel layers; 1e-4); B's tensors are bitwise A's
and B's logits at TP2xPP2 are bitwise A's. `export A --hf` in one process matches the engine in
transformers, and `h5ls -r` lists the tensors.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs import REPO, grpo, logs, read_all

HERE = Path(__file__).resolve().parent
LOGIT_TOL = 1e-4
IDS = torch.randint(5, 480, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()


def _launch(world: int, args: dict, workdir: Path, timeout: float = 400) -> None:
    from rank_launcher import launch_ranks

    launch_ranks(HERE / "ckpt_layout_ranks.py", world, args, workdir, timeout=timeout,
                 what="checkpoint layout scenario")


@pytest.fixture(scope="module")
def trained(tiny_assets, tmp_path_factory):
    """A: 2 GRPO steps at TP2xPP2 (4 ranks); C: 1 step at TP1 (1 rank in this process, so A and C
    differ)."""
    root = tiny_assets
    out_a, out_c = tmp_path_factory.mktemp("tp2pp2run"), tmp_path_factory.mktemp("tp1run")
    proc, _ = grpo(root, out_a, "trainer.total_steps=2", "parallel.tp=2", "parallel.pp=2",
                   "slurm.cpus_per_task=1", "actor.entropy_coeff=0.01", ranks=4)
    assert proc.returncode == 0, logs(proc, out_a)
    proc, _ = grpo(root, out_c, "trainer.total_steps=1", "actor.entropy_coeff=0.01")
    assert proc.returncode == 0, logs(proc, out_c)
    return root, out_a / "checkpoints" / "step_000002", out_c / "checkpoints" / "step_000001"


@pytest.fixture(scope="module")
def loaded(trained, tmp_path_factory):
    """4 ranks load A and C at TP1 (DP4) and at TP2xPP2; B is A saved again at TP1."""
    root, a, c = trained
    work = tmp_path_factory.mktemp("layouts")
    b = work / "b"
    _launch(4, {"model": str(root / "model"), "ids": IDS, "layouts": [
        {"name": "tp1", "tp": 1, "pp": 1, "load": [str(c), str(a)], "save": str(b)},
        {"name": "tp2pp2", "tp": 2, "pp": 2, "load": [str(a), str(c), str(b)]}]}, work / "ranks")
    logits = {f"{lay}:{src}": torch.load(work / "ranks" / f"{lay}.{i}.logits.pt", weights_only=True)
              for lay, srcs in (("tp1", "ca"), ("tp2pp2", "acb")) for i, src in enumerate(srcs)}
    return dict(a=a, b=b, logits=logits)


def test_ckpt_trainer_tp2pp2_to_tp1_and_back(loaded):
    lg = loaded["logits"]
    # saved at TP2xPP2 by the trainer -> loaded at TP1, and saved at TP1 -> loaded at TP2xPP2:
    # the same model up to fp32 summation order (TP splits the row-parallel reductions)
    for src in "ac":
        diff = (lg[f"tp1:{src}"] - lg[f"tp2pp2:{src}"]).abs().max().item()
        print(f"checkpoint {src}: max |logit TP1 - logit TP2xPP2| = {diff:.2e}")
        assert diff <= LOGIT_TOL, (src, diff)
    assert (lg["tp1:a"] - lg["tp1:c"]).abs().max() > 100 * LOGIT_TOL  # two different models
    assert torch.equal(lg["tp2pp2:b"], lg["tp2pp2:a"])  # B (A re-saved at TP1) loads to A's model
    ta, tb = read_all(loaded["a"]), read_all(loaded["b"])
    assert sorted(ta) == sorted(tb)
    assert [n for n in ta if not torch.equal(ta[n], tb[n])] == []  # model and optimizer, bitwise


def test_ckpt_trainer_hf_export_matches_engine(trained, loaded, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, a, _ = trained
    hf = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "verl_hpc.checkpoint", "export", str(a.parent), "--hf", str(hf)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (hf / "model.safetensors").is_file() and (hf / "config.json").is_file()
    AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = model(ids).logits
    assert (logits - loaded["logits"]["tp1:a"]).abs().max() <= LOGIT_TOL
    # the export is the trained model, not the starting one
    start = AutoModelForCausalLM.from_pretrained(root / "model", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert (start(ids).logits - logits).abs().max() > 1e-4
    h5ls = subprocess.run(["h5ls", "-r", str(a / "rank_00000.h5")], capture_output=True, text=True,
                          env=dict(os.environ, HDF5_USE_FILE_LOCKING="FALSE"))
    assert h5ls.returncode == 0 and "/tensors/actor/model/decoder.layers.0.self_attention.linear_qkv.weight" in h5ls.stdout
