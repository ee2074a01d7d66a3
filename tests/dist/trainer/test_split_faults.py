"""A rank of a split job that dies ends the whole job, named with its group: 1 rollout rank (vLLM) +
1 training rank (Megatron) through `python -m verl_hpc.submit --local`, one of them SIGKILLed mid-run
(a real death: no handler, no `error:` line of its own). The submitter exits non-zero within the
timeouts, lists the dead rank first with its group and signal, shows the survivor's line naming the
group it lost, and leaves no rank process behind."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from jobs import data_overrides

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 90  # collective and poll timeouts: above the two ranks' start-up skew on a loaded machine
# a survivor that waits in no timed call is stopped by the local launcher: SIGTERM, SIGKILL 30 s later
LAUNCHER_GRACE_S = 30


def start_split_job(root: Path, out: Path) -> subprocess.Popen:
    """A k=1 split job on the tiny model with far more steps than the test lets it run."""
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--local", f"model.path={root}/model",
           *data_overrides(root), f"trainer.output_dir={out}", f"slurm.log_dir={out}/logs/%j",
           "slurm.tasks_per_node=2", "slurm.cpus_per_task=1", "placement.mode=split", "placement.rollout_ranks=1",
           "async_training.staleness=1", "rollout.engine=vllm", "trainer.total_steps=5000", "trainer.val_every=0",
           "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=16",
           "checkpoint.save_every=0", "tracking.plots=false", f"trainer.collective_timeout_s={TIMEOUT_S}",
           f"async_training.poll_timeout_s={TIMEOUT_S}",
           "slurm.max_restarts=0"]  # the dead rank must end the job here (its restart: tests/jobs/test_restart_job.py)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rank_processes(submitter: subprocess.Popen):
    """({global rank: process}, [every process below them]): the job's ranks are the submitter's
    children whose environment says RANK=<n> (the local launcher sets it)."""
    ranks, below = {}, []
    for p in psutil.Process(submitter.pid).children():
        try:
            rank = p.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "verl_hpc.job" in p.cmdline():
            ranks[int(rank)] = p
            below += p.children(recursive=True)
    return ranks, below


def kill_mid_run(tmp_path, root, rank: int, wait_for_text):
    """Start the job, SIGKILL `rank` once the trainer has logged step 3, then wait for the job's end;
    returns (stderr, seconds from the kill to the submitter's exit, processes still alive)."""
    out = tmp_path / "out"
    proc = start_split_job(root, out)
    try:
        wait_for_text(out / "logs", "**/1/stdout.log", "step 3/", proc, timeout=400)
        ranks, below = rank_processes(proc)
        assert sorted(ranks) == [0, 1], ranks
        ranks[rank].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        try:
            _, err = proc.communicate(timeout=TIMEOUT_S + LAUNCHER_GRACE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job still runs {TIMEOUT_S + LAUNCHER_GRACE_S} s after rank {rank} died") from None
        elapsed = time.monotonic() - killed
    finally:
        proc.kill()
    gone_by = time.monotonic() + 10  # the launcher has reaped its ranks; their own children may lag
    alive = [p for p in [*ranks.values(), *below] if _alive(p)]
    while alive and time.monotonic() < gone_by:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    for p in alive:  # never leave one behind, whatever the verdict
        p.kill()
    return err, elapsed, alive


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def report(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("[submit]   ")]


def test_a_dead_rollout_rank_ends_the_job_naming_it(tmp_path, tiny_assets, wait_for_text):
    # global rank 0 is the rollout leader and serves the job's store: the trainer loses it at once
    err, elapsed, alive = kill_mid_run(tmp_path, tiny_assets, 0, wait_for_text)
    lines = report(err)
    assert lines and lines[0].startswith("[submit]   rank 0 (rollout) exited with code -9 (SIGKILL) (failed first)"), err
    assert any(line.startswith("[submit]   rank 1 (train) exited with code ") for line in lines), err
    # the trainer's own line names what it lost, at the wait it was in (not at its clean-up); on a
    # loaded machine the kill can land in the step's weight exchange instead, whose line names the
    # rollout group as well
    assert ("error: rank 1: training rank 0: lost the rollout group (global rank 0 (rollout rank 0), which "
            "serves the job's store) at '" in err
            or ("error: rank 1: training rank 0 (global 1): the weight exchange failed" in err
                and "the rollout group (global rank 0) died or is stuck" in err)), err
    assert "at 'ctl/stop'" not in err, err
    assert elapsed < TIMEOUT_S, f"took {elapsed:.0f}s after the rollout rank died"
    assert not alive, alive


def test_a_dead_training_rank_ends_the_job_naming_it(tmp_path, tiny_assets, wait_for_text):
    err, elapsed, alive = kill_mid_run(tmp_path, tiny_assets, 1, wait_for_text)
    lines = report(err)
    assert lines and lines[0].startswith("[submit]   rank 1 (train) exited with code -9 (SIGKILL) (failed first)"), err
    assert any(line.startswith("[submit]   rank 0 (rollout) exited with code ") for line in lines), err
    assert elapsed < TIMEOUT_S, f"took {elapsed:.0f}s after the training rank died"
    assert not alive, alive
