"""Preemption on the real dev cluster (issue 7): a GRPO job sent Slurm's warning signal finishes
its step, checkpoints, requeues itself (`scontrol requeue`), is started again by Slurm (the dev
cluster holds a requeued job ~120 s first), resumes from `latest` and completes every step, while
the submitter waits through REQUEUED/PENDING and reports success. Tiny: 1 rank, HF rollout."""
import json
import subprocess

import pytest

from rl_job import job_text, sacct_states, start_rl, steps_logged

pytestmark = pytest.mark.slurm

STEPS = 30


@pytest.fixture(scope="module", autouse=True)
def cluster_is_up():
    # one line per node (-N) and partition: usable when some node is
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and {"idle", "mixed", "allocated"} & set(r.stdout.split()), (
        f"dev cluster not usable (sinfo: {r.stdout!r} {r.stderr!r}); run slurm/devcluster/start.sh")


def test_ckpt_requeue_on_warning_signal_resumes_and_completes(tmp_path):
    proc, job_id, out, logs = start_rl(tmp_path, STEPS)
    try:
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        stdout, stderr = proc.communicate(timeout=600)  # ~120 s of Slurm's requeue hold included
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", job_id], timeout=30)
    text = job_text(stdout, stderr, logs)
    assert proc.returncode == 0, text[-8000:]
    assert "COMPLETED" in stdout, stdout[-3000:]
    assert "received SIGUSR2" in text and "requeued after the checkpoint of step" in text, text[-6000:]
    summary = json.loads((out / "rl_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["stopped"] == "completed", summary
    assert 0 < summary["resumed_from"] < STEPS, summary
    assert steps_logged(out) == list(range(1, STEPS + 1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:06d}"
    sacct = sacct_states(job_id)
    assert "REQUEUED" in sacct and sacct[-1] == "COMPLETED", sacct
