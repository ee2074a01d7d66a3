"""The stop-or-requeue rule on the real dev cluster (docs/signals.md): `scancel` stops a job for
good (CANCELLED, never requeued, no process left, a checkpoint only if one fitted in Slurm's
KillWait), while Slurm preempting the job (partition 'scavenger', slurm/devcluster/start.sh)
requeues it and it resumes from its checkpoint. `scancel --signal=USR2` (checkpoint, requeue, resume)
is job A of test_multinode.py."""
import json
import re
import subprocess
import time

import pytest

from rl_job import job_text, release_requeue_hold, sacct_states, start_rl, steps_logged


@pytest.fixture(scope="module", autouse=True)
def cluster_is_up():
    r = subprocess.run(["sinfo", "-h", "-o", "%P %T"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip(), f"dev cluster not usable (sinfo: {r.stdout!r} {r.stderr!r})"
    assert "scavenger" in r.stdout, ("the dev cluster has no 'scavenger' partition: run "
                                     "slurm/devcluster/start.sh (it configures preemption)")


def test_scancel_ends_cancelled_and_stays_ended(tiny_assets, tmp_path):
    proc, job_id, out, logs = start_rl(tiny_assets, tmp_path, 200)
    try:
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        cancelled = time.monotonic()
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", job_id], timeout=30)
    text = job_text(stdout, stderr, logs)
    assert proc.returncode != 0 and f"job {job_id} ended CANCELLED" in stderr, text[-6000:]
    assert "received SIGTERM: will checkpoint at the next step boundary if there is time" in text, text[-6000:]
    assert "requeue: job" not in text, text[-6000:]
    if "stopped by SIGTERM" in text:  # the step boundary came within Slurm's KillWait
        assert "not requeued (SIGTERM without preemption (JobState=" in text, text[-6000:]
    # A requeue comes from the job's own processes (runtime/requeue.py's `scontrol requeue` in the rank),
    # which live at most KillWait after the cancel's SIGTERM (then SIGKILL; none is left, checked
    # below): 10 s after that, a requeued job would be PENDING/REQUEUED (this used to wait 20 s after
    # the submitter's exit, itself seconds after the cancel)
    time.sleep(max(0.0, cancelled + _kill_wait_s() + 10 - time.monotonic()))
    assert sacct_states(job_id) == ["CANCELLED"] or sacct_states(job_id)[0].startswith("CANCELLED"), \
        sacct_states(job_id)
    assert len(sacct_states(job_id)) == 1, sacct_states(job_id)  # one attempt: never requeued
    _leaves_the_queue_without_coming_back(job_id)
    left = subprocess.run(["pgrep", "-f", str(logs)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the cancelled job still run: {left}"
    ckpts = out / "checkpoints"
    if (ckpts / "latest").exists():  # a checkpoint that fitted in the grace time is a whole one
        from verl_hpc.checkpoint.index import find_latest
        from verl_hpc.checkpoint.load import open_checkpoint

        with open_checkpoint(find_latest(ckpts)) as reader:
            assert reader.metadata["trainer_state"]["step"] >= 2


def _leaves_the_queue_without_coming_back(job_id: str, timeout_s: float = 120) -> None:
    """The job goes from the queue; until then it may only be completing (CG: slurmd still reaping
    its processes and running the epilog, which on a loaded node outlasts KillWait). Queued or
    running again (PD, R, ...) would be a requeue."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%t"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
        if state == "":
            return
        assert state == "CG", f"job {job_id} is {state} in squeue after its cancel: requeued or restarted"
        assert time.monotonic() < deadline, f"job {job_id} still completing (CG) {timeout_s:.0f} s after its cancel"
        time.sleep(1)


def _kill_wait_s() -> int:
    """Slurm's KillWait: the seconds between a job's SIGTERM and its SIGKILL."""
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    return int(re.search(r"^KillWait\s*=\s*(\d+)", config, re.M).group(1))


def _node_and_cpus(job_id: str):
    """The node our job runs on and its CPU count (the cluster may have several nodes). A job that
    asks for all of them fits the node's configuration, and only preempting ours makes room."""
    node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                          timeout=30).stdout.strip()
    cpus = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%C"], capture_output=True, text=True,
                          timeout=30).stdout.split()[0]  # allocated/idle/other/total
    return node, int(cpus.split("/")[3])


@pytest.mark.long  # a chain of launches: preempted, requeued by Slurm, resumed (make test-long)
@pytest.mark.timeout(1500)  # two start-ups of a few minutes each on a loaded CI machine
def test_slurm_preemption_requeues_and_resumes(tiny_assets, tmp_path):
    # long enough that the preemption lands mid-run on a quiet machine too (a few hundredths of a
    # second a step there), and that the job outlives one of the submitter's 15 s status lines with
    # steps logged (at 100 steps a quiet run ended between two of them: the status check below failed)
    steps = 400
    proc, job_id, out, logs = start_rl(tiny_assets, tmp_path, steps, "slurm.partition=scavenger")
    urgent = None
    try:
        # a job of a higher-tier partition that needs the CPUs ours holds: Slurm preempts ours
        node, total = _node_and_cpus(job_id)  # needs all of the node's CPUs: only preempting ours makes room
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "debug", "-w", node, "-c", str(total), "-J", "urgent",
                                 "-o", str(tmp_path / "urgent.out"), "--wrap", "sleep 10"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        assert release_requeue_hold(job_id, proc), "the preempted job was never requeued"
        stdout, stderr = proc.communicate(timeout=1300)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", job_id], timeout=30)
        if urgent:
            subprocess.run(["scancel", urgent], timeout=30)
    text = job_text(stdout, stderr, logs)
    assert proc.returncode == 0 and "COMPLETED" in stdout, text[-8000:]
    assert "received SIGTERM" in text and "with Slurm preempting the job" in text, text[-8000:]
    assert "requeued after the checkpoint of step" in text, text[-8000:]
    # the submitter's status line carried the step progress (from metrics.jsonl); which state it
    # caught is timing: the resumed run can finish between two 15 s status lines, leaving only the
    # PENDING lines of the requeue hold
    assert re.search(rf"\[submit\] job {job_id} (RUNNING|PENDING) \d\d:\d\d elapsed; step \d+/{steps} \(\d+%\) "
                     r"\S+ s/step ETA \S+", stdout), stdout[-4000:]
    summary = json.loads((out / "rl_summary.json").read_text())
    assert summary["steps"] == steps and summary["stopped"] == "completed", summary
    assert 0 < summary["resumed_from"] < steps, summary
    assert steps_logged(out) == list(range(1, steps + 1))
    states = sacct_states(job_id)
    assert "REQUEUED" in states or "PREEMPTED" in states, states
    assert states[-1] == "COMPLETED", states
