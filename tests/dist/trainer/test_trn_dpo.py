"""trainer.job=dpo through the real engine: one DPO step at TP2 and at PP2 gives the TP1 weights
(within 1e-5), and the step's first loss is log 2 (policy = reference).

lr 1e-4: Adam's first step moves each weight by about lr * g / (|g| + eps), so on weights whose
gradient is ~0 a float-rounding difference of the gradient between layouts becomes a visible
fraction of lr (measured: 4.6e-5 at lr 1e-3 for TP2), whatever the loss."""
import math

import pytest
import torch
from safetensors.torch import load_file

from trn_helpers import REPO, logs, make_assets, run_job

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = make_assets(tmp_path_factory.getbasetemp() / "trn_assets")
    if not (root / "data" / "preference_train.parquet").exists():
        import subprocess
        import sys
        subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "synthetic", str(root / "data"),
                        "--n-train", "64", "--n-val", "8", "--preference"], cwd=REPO, check=True,
                       capture_output=True)
    return root


def dpo(assets, out, ranks, *extra):
    proc, _ = run_job("configs/demo_dpo.yaml", out, f"model.path={assets}/model",
                      f"data.preference_files=[{assets}/data/preference_train.parquet]",
                      "data.preference_val_files=[]", f"data.train_files=[{assets}/data/train.parquet]",
                      f"data.val_files=[{assets}/data/val.parquet]", "data.train_batch_size=4",
                      "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2", "trainer.total_steps=1",
                      "trainer.val_every=0", "slurm.cpus_per_task=1", "actor.optim.lr=1e-4", *extra, ranks=ranks, timeout=600)
    assert proc.returncode == 0, logs(proc, out)
    import json
    summary = json.loads((out / "dpo_summary.json").read_text())
    return load_file(str(out / "hf" / "model.safetensors")), summary


def test_trn_dpo_step_tp2_pp2_equal_tp1(assets, tmp_path):
    base, summary = dpo(assets, tmp_path / "tp1", 1)
    assert summary["first_loss"] == pytest.approx(math.log(2), abs=1e-6)
    start = load_file(str(next((assets / "model").glob("*.safetensors"))))
    assert any(not torch.equal(base[k], start[k]) for k in base)  # the step changed the weights
    for name, extra in (("tp2", "parallel.tp=2"), ("pp2", "parallel.pp=2")):
        other, _ = dpo(assets, tmp_path / name, 2, extra)
        assert other.keys() == base.keys()
        worst = max(float((other[k] - base[k]).abs().max()) for k in base)
        assert worst <= 1e-5, (name, worst)
