"""Preemption on the real dev cluster (issue 7): a GRPO job sent Slurm's warning signal finishes
its step, checkpoints, requeues itself (`scontrol requeue`), is started again by Slurm (the dev
cluster holds a requeued job ~120 s first), resumes from `latest` and completes every step, while
the submitter waits through REQUEUED/PENDING and reports success. Tiny: 1 rank, HF rollout."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "dist" / "trainer"))
from trn_helpers import data_overrides, make_assets  # noqa: E402

STEPS = 30


@pytest.fixture(scope="module", autouse=True)
def cluster_is_up():
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    states = r.stdout.split()  # one line per node
    assert r.returncode == 0 and states and all(x in ("idle", "mixed", "allocated", "completing")
                                                for x in states), (
        f"dev cluster not usable (sinfo: {r.stdout!r} {r.stderr!r}); run slurm/devcluster/start.sh")


def _steps_logged(out: Path) -> list:
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line)["step"] for line in f.read_text().splitlines() if line.strip().endswith("}")]


def test_ckpt_requeue_on_warning_signal_resumes_and_completes(tmp_path):
    root = make_assets(tmp_path / "assets")
    out, logs = tmp_path / "out", tmp_path / "logs"
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", f"model.path={root}/model",
           *data_overrides(root), f"trainer.output_dir={out}", f"slurm.log_dir={logs}/%j",
           f"trainer.total_steps={STEPS}", "rollout.engine=hf", "data.train_batch_size=4", "rollout.n=4",
           "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=8", "trainer.val_every=0", "tracking.backends=[jsonl]",
           "tracking.plots=false", "slurm.tasks_per_node=1", "slurm.time_min=15", "slurm.requeue=true"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.time() + 300
        while time.time() < end and proc.poll() is None and len(_steps_logged(out)) < 2:
            time.sleep(0.5)
        if len(_steps_logged(out)) < 2:
            proc.kill()
            o, e = proc.communicate()
            raise AssertionError(f"the job never logged 2 steps:\n{o[-4000:]}\n{e[-4000:]}")
        job_id = next(p.name for p in logs.iterdir() if p.name.isdigit())
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        stdout, stderr = proc.communicate(timeout=600)  # ~120 s of Slurm's requeue hold included
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", job_id], timeout=30) if "job_id" in locals() else None
    text = stdout + stderr + "".join(f.read_text(errors="replace") for f in sorted(logs.rglob("*_log.*")))
    assert proc.returncode == 0, text[-8000:]
    assert "COMPLETED" in stdout, stdout[-3000:]
    assert "received SIGUSR2" in text and "requeued after the checkpoint of step" in text, text[-6000:]
    summary = json.loads((out / "rl_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["stopped"] == "completed", summary
    assert 0 < summary["resumed_from"] < STEPS, summary
    assert _steps_logged(out) == list(range(1, STEPS + 1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:06d}"
    sacct = subprocess.run(["sacct", "-j", job_id, "-D", "-X", "-n", "-o", "State"], capture_output=True,
                           text=True, timeout=30).stdout.split()
    assert "REQUEUED" in sacct and sacct[-1] == "COMPLETED", sacct
