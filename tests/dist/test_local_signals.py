"""Signals to a local job (`python -m verl_hpc.submit ... --local`), as a user at a terminal sends
them: SIGTERM (`kill PID`) and SIGUSR2 (`kill -USR2 PID`, the warning signal) to the submitter,
Ctrl-C (SIGINT to the terminal's process group). Each must end like a Slurm cancel: the step in
flight finishes, its checkpoint is complete and `latest` names it, one line says how to resume, and
the exit code is the shell's 128 + signal number. The
SIGTERM case runs split placement (1 rollout + 1 training rank, k = 2), whose ranks must all leave
at the stop, none waiting out trainer.collective_timeout_s (300 s here) on the other group; the
races of that stop, made deterministic, are tests/unit/trainer/test_async_stop.py."""
import contextlib
import os
import signal
import subprocess
import sys

import pytest
from jobs import REPO, TINY_GRPO, data_overrides, metrics

# checkpoint every step: a signal right after a step's metrics lands on that step's save
STEPS = ["trainer.total_steps=200", "checkpoint.save_every=1", "checkpoint.keep_last=2"]
SPLIT = ["placement.mode=split", "placement.rollout_ranks=1", "slurm.tasks_per_node=2", "slurm.cpus_per_task=1",
         "async_training.staleness=2", "rollout.engine=vllm"]


def start_job(assets, out, *extra):
    """The job in its own session (as a shell starts a command in its own process group)."""
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--local",
           f"model.path={assets}/model", *data_overrides(assets), *TINY_GRPO, *STEPS, *extra,
           f"trainer.output_dir={out}", f"slurm.log_dir={out}/logs/%j"]
    console = open(out.parent / f"{out.name}_console.txt", "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=console, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True), console


@pytest.mark.parametrize("sig, send, code, placement", [
    ("SIGTERM", lambda pid: os.kill(pid, signal.SIGTERM), 143, SPLIT),   # kill PID: the submitter only
    ("SIGINT", lambda pid: os.killpg(pid, signal.SIGINT), 130, []),      # Ctrl-C: the whole process group
    # Slurm's warning signal, sent by hand: it ended the submitter at once (issue 83, item 4). In make
    # test-long (a third launch of the same stop): make test keeps SIGTERM's and Ctrl-C's, which take
    # the same path once the submitter has the signal; the submitter's SIGUSR2 handler is
    # tests/unit/test_startup_signals.py's, the flag on every rank test_local_launch.py's USR2 case
    pytest.param("SIGUSR2", lambda pid: os.kill(pid, signal.SIGUSR2), 140, [], marks=pytest.mark.long),
], ids=["SIGTERM-split", "SIGINT-colocated", "SIGUSR2-colocated"])
def test_signal_stops_at_a_step_with_a_complete_checkpoint(terminal_sigint, tiny_assets, tmp_path, wait_for_text, sig,
                                                           send, code, placement):
    out = tmp_path / "run"
    out.mkdir()
    proc, console = start_job(tiny_assets, out, *placement)
    try:
        wait_for_text(out, "metrics.jsonl", '"step": 1', proc, timeout=240)
        send(proc.pid)
        proc.wait(timeout=120)  # well inside the 300 s a wait that missed the stop would sit out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        console.close()
    said = (tmp_path / "run_console.txt").read_text(errors="replace")
    assert proc.returncode == code, said[-4000:]
    assert "Traceback" not in said and "error:" not in said, said[-4000:]
    stops = [line for line in said.splitlines() if line.startswith(f"[submit] stopped by {sig}")]
    assert len(stops) == 1, said[-4000:]
    assert "resume with: " in stops[0] and "verl_hpc.submit configs/demo_rl.yaml --local" in stops[0], stops

    # at a step boundary: the checkpoint `latest` names is the last step the run logged, complete
    latest = (out / "checkpoints" / "latest").read_text().strip()
    last = metrics(out)[-1]["step"]
    assert latest == f"step_{last:06d}" and f"at step {last};" in stops[0], (latest, last, stops)
    # `python -m verl_hpc.checkpoint verify`'s main, in this process (no interpreter to start for it)
    from verl_hpc.checkpoint.__main__ import main as checkpoint_cli

    assert checkpoint_cli(["verify", str(out / "checkpoints")]) == 0


def test_ranks_end_with_a_launcher_killed_outright(tmp_path, smoke_job, wait_for_text):
    """SIGKILL of the submitter (the OOM killer, `kill -9`): torch's agent starts every rank in a
    session of its own, so only the ranks' own watch (runtime/orphans.py) can end them."""
    import psutil

    proc = smoke_job(tmp_path, "slurm.tasks_per_node=2", "trainer.smoke.steps=100000")
    below = []  # the submitter's processes, the ranks among them: never the worker's other children
    try:  # (the fork server the dist scenarios fork their ranks from, multiprocessing's resource tracker)
        wait_for_text(tmp_path / "logs", "**/0/stderr.log", "smoke step 2/", proc, timeout=240)
        below = psutil.Process(proc.pid).children(recursive=True)
        ranks = [c for c in below if "verl_hpc.job" in " ".join(c.cmdline())]
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(ranks, timeout=30)
    finally:
        with contextlib.suppress(psutil.Error):
            below = below or psutil.Process(proc.pid).children(recursive=True)
        for p in below:
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.kill()
    assert not alive, f"ranks still running 30 s after their launcher was killed: {alive}"
    logs = "".join(f.read_text() for f in (tmp_path / "logs").rglob("stderr.log"))
    assert "the local launcher (pid" in logs and "is gone (killed?): this rank stops too" in logs, logs[-2000:]
