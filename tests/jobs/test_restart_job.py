"""A rank that dies costs the steps since the last checkpoint, not the job (issue 94, items 3 and 4):
a 2-rank tiny GRPO job through the command line (`python -m verl_hpc.submit --local`), saving every
step, with a rank ended at a chosen step, is relaunched by its submitter from `latest`, finishes
every step, counts the restart (the job/restarts metric, the summary, the submitter's lines) and ends
with the same weights, Adam moments and per-step metrics as the job without the fault, bitwise.
Each fault the issue names: SIGKILL mid-step, SIGSEGV, a rank stuck outside collectives (in Python:
its stage watchdog, exit 16; stopped outright: its heartbeat), a rank killed inside a checkpoint save
(nothing lost: the save is atomic). Past slurm.max_restarts the job ends with one line, its
checkpoint intact, and no further launch. The seconds each fault costs are printed (docs/resilience.md).
The Slurm tier: tests/slurm/test_restarts_slurm.py."""
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from jobs import MOVING, data_overrides, logs, metrics, read_all, run_job, stable_metrics

STEPS = 4
ARGS = ["rollout.engine=hf", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=4", "trainer.val_every=0", "tracking.backends=[jsonl]", "tracking.plots=false",
        f"trainer.total_steps={STEPS}", "checkpoint.save_every=1", "slurm.restart_backoff_s=0", *MOVING]


def job(root: Path, out: Path, *extra, fault: str = "", act=None):
    """The job on 2 local ranks (fault: VERL_HPC_FAULT; act(out, stop): a thread beside it);
    returns (CompletedProcess, summary, seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "VERL_HPC_FAULT"}
    if fault:
        env["VERL_HPC_FAULT"] = fault
    stop = threading.Event()
    side = threading.Thread(target=act, args=(out, stop), daemon=True) if act else None
    if side:
        side.start()
    t0 = time.monotonic()
    try:
        proc, summary = run_job("configs/demo_rl.yaml", out, f"model.path={root}/model", *data_overrides(root),
                                *ARGS, *extra, ranks=2, timeout=600, env=env)
    finally:
        stop.set()
    if side:
        side.join(timeout=30)
    return proc, summary, time.monotonic() - t0


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    proc, summary, seconds = job(tiny_assets, out)
    assert proc.returncode == 0 and summary["restarts"] == 0, logs(proc, out)
    return out, seconds


STAMP = re.compile(r"^\[rank\d+\] (\d\d):(\d\d):(\d\d) ")


def stamps(log: Path, text: str = "") -> list:
    """Seconds of the day of a rank log's lines (holding `text`)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if m and text in line:
            out.append(int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3)))
    return out


def timeline(straight: Path, out: Path, rank: int, step: int) -> str:
    """Where a relaunch's seconds went, from the ranks' logs (1 s resolution): from the dead rank's
    last line in the first launch to the relaunched rank 0 up, resumed, and saving `step` again,
    against that step's own seconds in the run without the fault."""
    first, last = [sorted(out.glob(f"logs/*/*-{n:02d}_*/attempt_0"))[0] for n in (0, 1)]
    t0 = stamps(first / str(rank) / "stderr.log")[-1]
    r0 = last / "0" / "stderr.log"
    up, resumed = stamps(r0, " up via ")[0], stamps(r0, "resume: loaded")[0]
    again = stamps(r0, f"checkpoint: step {step} ->")[0]
    s0 = sorted(straight.glob("logs/*/*-00_*/attempt_0"))[0] / "0" / "stderr.log"
    own = stamps(s0, f"checkpoint: step {step} ->")[0] - stamps(s0, f"checkpoint: step {step - 1} ->")[0]
    return (f"fault -> relaunched ranks up {up - t0} s, checkpoint loaded {resumed - t0} s, step {step} saved "
            f"again {again - t0} s (the step alone: {own} s): about {again - t0 - own} s lost")


def restarted(straight, proc, summary, seconds, out, how: str, restarts: int = 1):
    """The faulted job finished every step after `restarts` relaunches and ends as the straight one."""
    assert proc.returncode == 0 and summary["steps"] == STEPS and summary["restarts"] == restarts, logs(proc, out)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[restart] ") and "; restarted from " in ln]
    assert len(lines) == restarts and how in lines[0], proc.stdout[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith(
        f"[submit] local job finished OK after {restarts} restart(s) of its ranks"), proc.stdout[-2000:]
    a, b = read_all(straight[0] / "checkpoints"), read_all(out / "checkpoints")
    assert sorted(a) == sorted(b) and any(n.startswith("actor/optim/exp_avg/") for n in a)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []  # bitwise
    ma, mb = stable_metrics(straight[0]), stable_metrics(out)
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    assert [{k: v for k, v in m.items() if k != "job/restarts"} for m in ma] == \
        [{k: v for k, v in m.items() if k != "job/restarts"} for m in mb]
    m = re.search(r"rank (\d+) \w+ .* at step (\d+)", lines[0])
    print(f"\n[restart job] {how}: {seconds:.1f} s against {straight[1]:.1f} s without the fault; "
          f"{timeline(straight[0], out, int(m.group(1)), int(m.group(2)))}")
    return [m["job/restarts"] for m in metrics(out)]


def test_a_rank_sigkilled_mid_step_is_relaunched_and_the_run_ends_bitwise(tiny_assets, straight, tmp_path):
    proc, summary, seconds = job(tiny_assets, tmp_path, fault="step:1:3:sigkill")
    counted = restarted(straight, proc, summary, seconds, tmp_path, "rank 1 died (SIGKILL) at step 3")
    assert counted == [0, 0, 1, 1]  # steps 1-2 in the first launch; 3-4 replayed from step 2's checkpoint
    assert "[restart] rank 1 died (SIGKILL) at step 3; restarted from step 2 (1 of 2)" in proc.stdout


@pytest.mark.long  # a second relaunch of the path above (make test: the SIGKILL case)
def test_a_segfault_is_relaunched_and_the_run_ends_bitwise(tiny_assets, straight, tmp_path):
    proc, summary, seconds = job(tiny_assets, tmp_path, fault="update:0:2:sigsegv")
    restarted(straight, proc, summary, seconds, tmp_path, "rank 0 died (SIGSEGV) at step 2; restarted from step 1")


@pytest.mark.long  # waits out a stage watchdog
def test_a_rank_stuck_outside_collectives_is_ended_by_its_watchdog_and_relaunched(tiny_assets, straight, tmp_path):
    proc, summary, seconds = job(tiny_assets, tmp_path, "trainer.stage_timeout_s=8", fault="step:1:3:hang")
    restarted(straight, proc, summary, seconds, tmp_path,
              "rank 1 died (exit code 16: stalled outside collectives) at step 3; restarted from step 2")


def beat_of(out: Path, launch: int, rank: int):
    from verl_hpc.launcher import heartbeat

    found = sorted(out.glob(f"logs/*/heartbeats/launch{launch}/rank{rank}"))
    return heartbeat.read(str(found[0])) if found else None


def on_step(launches, rank: int, step: int, do):
    """A side thread: `do(pid)` once in each of `launches` when `rank` beats at `step` or later."""
    def act(out, stop):
        for launch in launches:
            while not stop.is_set():
                beat = beat_of(out, launch, rank)
                if beat is not None and beat.step >= step:
                    do(beat.pid)
                    break
                time.sleep(0.05)
    return act


@pytest.mark.long  # waits out a heartbeat timeout
def test_a_stopped_rank_is_found_by_its_heartbeat_killed_and_relaunched(tiny_assets, straight, tmp_path):
    """SIGSTOP: the rank runs no Python at all (as one holding the GIL in a C call that never
    returns, or stuck in the kernel), so its own watchdog cannot act; its heartbeat stops."""
    proc, summary, seconds = job(tiny_assets, tmp_path, "trainer.heartbeat_timeout_s=15",
                                 act=on_step([0], 1, 3, lambda pid: os.kill(pid, signal.SIGSTOP)))
    restarted(straight, proc, summary, seconds, tmp_path, "rank 1 stopped (no heartbeat for 1")
    assert "[restart] rank 1: no heartbeat for 1" in proc.stdout and ": killed" in proc.stdout


@pytest.mark.long  # another relaunch (make test: the SIGKILL case)
def test_a_rank_killed_inside_a_checkpoint_save_loses_nothing(tiny_assets, straight, tmp_path):
    """Rank 1 dies after its file of step 2's save, before the commit: `latest` still names step 1,
    the half-written folder is removed by the next save, and step 2 is done again."""
    proc, summary, seconds = job(tiny_assets, tmp_path, fault="save:1:2:sigkill")
    restarted(straight, proc, summary, seconds, tmp_path, "rank 1 died (SIGKILL) at step 2; restarted from step 1")
    assert "left by an interrupted checkpoint save" in logs(proc, tmp_path)
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))


@pytest.mark.long  # two launches that both fail
def test_past_max_restarts_the_job_ends_with_one_line_and_its_checkpoint(tiny_assets, tmp_path):
    """Rank 1 is killed at step 3 in every launch (SIGKILL from outside: the hook fires in the first
    launch only); with slurm.max_restarts = 1 the second death ends the job: exit 34, one line, the
    checkpoint of step 2 intact, no third launch."""
    proc, summary, _ = job(tiny_assets, tmp_path, "slurm.max_restarts=1",
                           act=on_step([0, 1], 1, 3, lambda pid: os.kill(pid, signal.SIGKILL)))
    assert proc.returncode == 34, logs(proc, tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[restart] ")]
    assert lines == ["[restart] rank 1 died (SIGKILL) at step 3; restarted from step 2 (1 of 1)",
                     "[restart] rank 1 died (SIGKILL) at step 3; not restarted: the 1 restart(s) of "
                     "slurm.max_restarts = 1 are spent; the job ends with its checkpoint of step 2"], proc.stdout
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert len(list(tmp_path.glob("logs/*/heartbeats/launch*"))) == 2  # no third launch
    assert "[submit] local job FAILED" in proc.stderr
