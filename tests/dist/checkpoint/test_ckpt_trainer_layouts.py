"""A trainer checkpoint written at one parallel layout loads at another (issue 7), and its HF
export loads in transformers with the engine's logits.

One GRPO job at TP2 (2 ranks, 2 steps) writes checkpoint A. Then 2 gloo ranks (ckpt_layout_ranks.py):
  tp1 (DP2): load A -> logits; save the loaded state again as checkpoint B (written at TP1)
  tp2:       load A -> logits; load B -> logits
TP1 and TP2 logits of A agree to fp32 rounding (different reduction order), B's tensors are
bitwise A's (save at TP2 -> load at TP1 -> save), and the TP2 logits of B equal those of A
(the reverse direction). `export A --hf` in one process then matches the engine in transformers.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_trainer_helpers import REPO, grpo, logs, make_assets, read_all

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent
LOGIT_TOL = 1e-4


def _launch(world: int, args: dict, workdir: Path, timeout: float = 400) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "args.json").write_text(json.dumps(args))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        log = open(workdir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(HERE / "ckpt_layout_ranks.py"), str(workdir)],
                                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = False
    for proc, log in procs:
        try:
            failed |= proc.wait(timeout=timeout) != 0
        except subprocess.TimeoutExpired:
            failed = True
        log.close()
    for proc, _ in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if failed:
        raise AssertionError("\n".join((workdir / f"rank{r}.log").read_text()[-4000:] for r in range(world)))


@pytest.fixture(scope="module")
def saved_at_tp2(tmp_path_factory):
    root = make_assets(tmp_path_factory.getbasetemp() / "trn_assets")
    out = tmp_path_factory.mktemp("tp2run")
    proc, s = grpo(root, out, "trainer.total_steps=2", "parallel.tp=2", "slurm.cpus_per_task=1",
                   "actor.entropy_coeff=0.01", ranks=2)
    assert proc.returncode == 0, logs(proc, out)
    return root, out / "checkpoints" / "step_000002"


def test_ckpt_trainer_tp2_to_tp1_and_back(saved_at_tp2, tmp_path):
    root, a = saved_at_tp2
    b = tmp_path / "b"
    ids = torch.randint(5, 480, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()
    _launch(2, {"model": str(root / "model"), "ids": ids, "layouts": [
        {"name": "tp1", "tp": 1, "pp": 1, "load": [str(a)], "save": str(b)},
        {"name": "tp2", "tp": 2, "pp": 1, "load": [str(a), str(b)]}]}, tmp_path / "ranks")
    tp1, tp2a, tp2b = (torch.load(tmp_path / "ranks" / f, weights_only=True)
                       for f in ("tp1.0.logits.pt", "tp2.0.logits.pt", "tp2.1.logits.pt"))
    assert (tp1 - tp2a).abs().max() <= LOGIT_TOL
    assert torch.equal(tp2a, tp2b)  # B (written at TP1) loads at TP2 to the same model as A
    ta, tb = read_all(a), read_all(b)
    assert sorted(ta) == sorted(tb)
    assert [n for n in ta if not torch.equal(ta[n], tb[n])] == []
    torch.save(tp1, tmp_path.parent / "engine_tp1_logits.pt")  # for the export test


def test_ckpt_trainer_hf_export_matches_engine(saved_at_tp2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, a = saved_at_tp2
    ids = torch.randint(5, 480, (3, 12), generator=torch.Generator().manual_seed(0))
    ref = tmp_path.parent / "engine_tp1_logits.pt"
    if not ref.exists():
        pytest.skip("needs test_ckpt_trainer_tp2_to_tp1_and_back's engine logits")
    hf = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "verl_hpc.checkpoint", "export", str(a.parent), "--hf", str(hf)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (hf / "model.safetensors").is_file() and (hf / "config.json").is_file()
    AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
    engine = torch.load(ref, weights_only=True)
    assert (logits - engine).abs().max() <= LOGIT_TOL
    # the export is the trained model, not the starting one
    start = AutoModelForCausalLM.from_pretrained(root / "model", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert (start(ids).logits - logits).abs().max() > 1e-4
    h5ls = subprocess.run(["h5ls", "-r", str(a / "rank_00000.h5")], capture_output=True, text=True,
                          env=dict(os.environ, HDF5_USE_FILE_LOCKING="FALSE"))
    assert h5ls.returncode == 0 and "/tensors/actor/model/decoder.layers.0.self_attention.linear_qkv.weight" in h5ls.stdout
