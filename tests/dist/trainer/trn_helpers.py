"""Shared set-up for the trainer's dist tests: a tiny model and the synthetic task, built once."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def make_assets(root: Path, sft_noise: float = 0.62) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "verl_hpc.models.tiny", str(root / "model"), "--layers", "2"],
                       cwd=REPO, check=True, capture_output=True)
    if not (root / "data" / "kto_train.parquet").exists():  # the last file written
        subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "synthetic", str(root / "data"),
                        "--n-train", "2000", "--n-val", "100", "--sft-noise", str(sft_noise), "--preference"],
                       cwd=REPO, check=True, capture_output=True)
    return root


def warm_start(root: Path) -> Path:
    """The SFT warm start on the noisy labels (about 40% greedy accuracy), built once per session
    under `root/sft/hf` and shared by the RL and preference learning tests."""
    out = root / "sft"
    if not (out / "hf" / "model.safetensors").exists():
        proc, _ = run_job("configs/demo_sft.yaml", out, f"model.path={root}/model", *data_overrides(root),
                          "trainer.total_steps=600", "trainer.sft_epochs=30", f"trainer.hf_output_dir={out}/hf")
        assert proc.returncode == 0, logs(proc, out)
    return out / "hf"


def data_overrides(root: Path):
    return [f"data.train_files=[{root}/data/train.parquet]", f"data.val_files=[{root}/data/val.parquet]",
            f"data.sft_files=[{root}/data/sft.parquet]"]


def run_job(config: str, out: Path, *overrides, ranks: int = 1, timeout: int = 400, env=None):
    """One local job; returns (CompletedProcess, rank 0's summary dict or None)."""
    cmd = [sys.executable, "-m", "verl_hpc.submit", config, "--local", f"slurm.tasks_per_node={ranks}",
           f"trainer.output_dir={out}", f"slurm.log_dir={out}/logs/%j", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    summary = None
    for name in ("rl_summary.json", "sft_summary.json", "dpo_summary.json"):
        if (out / name).exists():
            summary = json.loads((out / name).read_text())
    return proc, summary


def metrics(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def logs(proc, out: Path) -> str:
    text = proc.stdout[-4000:] + proc.stderr[-4000:]
    for f in sorted(out.glob("logs/**/*.log")):
        text += f"\n--- {f}\n" + f.read_text(errors="replace")[-3000:]
    return text
