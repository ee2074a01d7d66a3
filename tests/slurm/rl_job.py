"""The tiny jobs the Slurm stop/requeue tests submit, and what they read back from them.

    proc, job_id, out, logs = start_rl(root, tmp_path, steps, *overrides)  # once 2 steps are logged
    proc, job_id, out, logs = start_job(config, tmp_path, overrides)       # any program
    proc, job_id, out, logs = start_job(config, tmp_path, overrides, ready=placed)  # once rank 0 is placed
    text = job_text(stdout, stderr, logs)                                  # submitter output + rank logs
    steps_logged(out), sacct_states(job_id), release_requeue_hold(job_id, proc)

One rank, HF rollout, checkpoints on, `slurm.requeue=true`: small enough to start in a few minutes on
a loaded machine, long enough (`steps`) for a signal to land mid-run.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
from jobs import data_overrides


def steps_logged(out: Path) -> list:
    """The steps metrics.jsonl holds so far (a line still being written is skipped)."""
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line)["step"] for line in f.read_text().splitlines() if line.strip().endswith("}")]


def start_rl(root: Path, tmp_path: Path, steps: int, *extra):
    """Submit the job (model and data under `root`, tests/jobs.py) with `python -m verl_hpc.submit`
    and wait until it has logged 2 steps. Returns (submitter process, job id, output dir, log dir);
    the caller waits for or kills it."""
    return start_job("configs/demo_rl.yaml", tmp_path, [
        f"model.path={root}/model", *data_overrides(root), f"trainer.total_steps={steps}", "rollout.engine=hf",
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=8",
        "trainer.val_every=0", *extra])


def logged_two_steps(out: Path, logs: Path) -> bool:
    """start_job's default moment: the job has logged 2 steps."""
    return len(steps_logged(out)) >= 2


def placed(out: Path, logs: Path) -> bool:
    """Rank 0 has logged its placement (Megatron is up, the rank's PreemptionFlag long installed),
    before its first step: a signal sent now stops it at step 1 whatever a step costs."""
    return any("placement:" in f.read_text(errors="replace") for f in logs.glob("*/*_0_log.err"))


def start_job(config: str, tmp_path: Path, args, ready=logged_two_steps):
    """`python -m verl_hpc.submit config args` on the cluster, one rank, metrics to out/metrics.jsonl,
    requeue on; once `ready(out, logs)` (default: 2 steps logged): (submitter process, job id,
    output dir, log dir)."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    cmd = [sys.executable, "-m", "verl_hpc.submit", config, f"trainer.output_dir={out}", f"slurm.log_dir={logs}/%j",
           "tracking.backends=[jsonl]", "tracking.plots=false", "slurm.tasks_per_node=1", "slurm.time_min=15",
           "slurm.requeue=true", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.time() + 300
    while time.time() < end and proc.poll() is None and not ready(out, logs):
        time.sleep(0.1)
    if not ready(out, logs):
        proc.kill()
        o, e = proc.communicate()
        raise AssertionError(f"the job never reached {ready.__name__}:\n{o[-4000:]}\n{e[-4000:]}")
    job_id = next(p.name for p in logs.iterdir() if p.name.isdigit())
    return proc, job_id, out, logs


def job_text(stdout: str, stderr: str, logs: Path) -> str:
    """The submitter's output and every rank log of every attempt, for assertions and their messages."""
    return stdout + stderr + "".join(f.read_text(errors="replace") for f in sorted(logs.rglob("*_log.*")))


def sacct_states(job_id: str) -> list:
    """One State per attempt of the job (-D: requeued attempts too), oldest first."""
    return subprocess.run(["sacct", "-j", job_id, "-D", "-X", "-n", "-o", "State"], capture_output=True,
                          text=True, timeout=30).stdout.split()


def release_requeue_hold(job_id: str, proc, timeout: float = 900) -> bool:
    """Slurm holds a requeued job before it may start again (PENDING, reason BeginTime) for
    AuthInfo's cred_expire, 120 s by default. The wait tests nothing of ours, so release the job
    as an admin would (`scontrol update StartTime=now`) once it is held. Returns True once
    released; False if the submitter `proc` ended first or `timeout` passed."""
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True,
                               timeout=30).stdout.split()
        if state[:2] == ["PENDING", "BeginTime"]:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)
            return True
        time.sleep(0.5)
    return False
