"""SFT preempted on the dev cluster: Slurm's warning signal (USR2, as `--signal=USR2@N` sends it
before the time limit) reaches the rank once it is placed, before its first step ends; it saves
step 1, requeues the job, and the requeued attempt resumes from `latest` and ends bitwise where an
uninterrupted run ends (the HF folder, the final checkpoint, every per-step loss). The
uninterrupted run is the same job in this process (tests/jobs.py's run_here: one thread, as the
Slurm rank). A signal at a later step is tests/jobs/test_sft_resume.py's (in this process)."""
import json
import subprocess

import pytest
import torch

from jobs import data_overrides, read_all, run_here, stable_metrics
from rl_job import job_text, placed, release_requeue_hold, sacct_states, start_job, steps_logged

# The signal is sent once rank 0 is placed, before its first step ends (the rest of its start-up
# takes longer than Slurm takes to deliver a signal): the stop is at step 1 whatever a step costs,
# and the resumed attempt has steps enough to follow (it was 400 steps and a signal after step 2)
STEPS = 12


def args(root, out):
    return [f"model.path={root}/model", *data_overrides(root), "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=8", f"trainer.total_steps={STEPS}",
            f"trainer.hf_output_dir={out}/hf"]


@pytest.mark.long  # a chain of launches: requeued by the warning signal, resumed (make test-long)
@pytest.mark.timeout(1500)
def test_sft_requeued_by_the_warning_signal_resumes_bitwise(tiny_assets, tmp_path):
    proc, job_id, out, logs = start_job("configs/demo_sft.yaml", tmp_path, args(tiny_assets, tmp_path / "out"),
                                        ready=placed)
    try:
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        assert release_requeue_hold(job_id, proc), "the signalled job was never requeued"
        stdout, stderr = proc.communicate(timeout=1300)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", job_id], timeout=30)
    text = job_text(stdout, stderr, logs)
    assert proc.returncode == 0 and "COMPLETED" in stdout, text[-8000:]
    assert "received SIGUSR2" in text and "requeued after the checkpoint of step" in text, text[-8000:]
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["stopped"] == "completed" and 0 < summary["resumed_from"] < STEPS, \
        summary
    assert steps_logged(out) == list(range(1, STEPS + 1))
    assert sacct_states(job_id)[-1] == "COMPLETED" and len(sacct_states(job_id)) >= 2, sacct_states(job_id)

    ref = tmp_path / "straight"
    proc, s = run_here("configs/demo_sft.yaml", ref, *args(tiny_assets, ref), "tracking.backends=[jsonl]",
                       "tracking.plots=false")
    assert proc.returncode == 0 and s["steps"] == STEPS, proc.stderr[-4000:]
    a, b = read_all(ref / "checkpoints"), read_all(out / "checkpoints")
    assert sorted(a) == sorted(b) and not [n for n in a if not torch.equal(a[n], b[n])], "not bitwise equal"
    from safetensors.torch import load_file

    ha, hb = load_file(str(ref / "hf" / "model.safetensors")), load_file(str(out / "hf" / "model.safetensors"))
    assert all(torch.equal(ha[n], hb[n]) for n in ha)
    assert stable_metrics(ref) == stable_metrics(out)
