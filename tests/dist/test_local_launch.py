"""The local backend of the submitter: real ranks on this machine talking over gloo.

The wedged-rank job spends its time waiting (its collective timeout, then torch's grace before it
kills the wedged rank), not computing: it starts before this module's first test and its test,
the module's last, collects it, so that the other tests run in that wait."""
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def submit(tmp_path, *overrides, timeout=180):
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/smoke.yaml", "--local",
           f"trainer.output_dir={tmp_path}/out", f"slurm.log_dir={tmp_path}/logs/%j", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.check
def test_two_local_ranks_agree(tmp_path):
    r = submit(tmp_path, "slurm.tasks_per_node=2", "trainer.smoke.steps=3")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "out" / "smoke_result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 3 and result["ok"]
    assert sorted(x["rank"] for x in result["ranks"]) == [0, 1]
    assert all(x["launcher"] == "torchrun" and x["torch_world"] == 2 for x in result["ranks"])
    assert "SMOKE_RESULT" in r.stdout  # rank 0's output reaches the console


def test_dead_rank_fails_fast_and_is_named(tmp_path, smoke_job, failure_after):
    proc = smoke_job(tmp_path, "trainer.smoke.steps=200", "trainer.smoke.fail_rank=1",
                     "trainer.smoke.fail_at_step=2")
    _, err, elapsed = failure_after(proc, tmp_path / "logs", "**/1/stderr.log", "dies on purpose")
    assert proc.returncode != 0
    assert elapsed < 60, f"took {elapsed:.0f}s to notice a dead rank"
    assert "rank 1 exited with code 3" in err, err
    listed = [line.split()[2] for line in err.splitlines() if line.startswith("[submit]   rank ")]
    assert listed[0] == "1", err  # the rank that died first is listed first, whatever its number
    log = Path(err.split("rank 1 exited with code 3")[1].split("log: ")[1].split()[0])
    assert log.exists() and "dies on purpose" in log.read_text()


@pytest.mark.parametrize("sig, to", [("USR2", "ranks"), ("TERM", "ranks"), ("USR2", "submitter")])
def test_warning_signal_sets_flag_on_every_rank(tmp_path, sig, to):
    """Sent to every rank (what Slurm's --signal=USR2@N or a preemption's SIGTERM does), or to the
    submitter (`kill -USR2 PID`), the signal stops every rank at one step boundary, and the
    submitter says so and exits 128 + its number. Issue 83, item 4: SIGUSR2 to the submitter killed
    it at once (140, silent; the ranks then stopped without a checkpoint), and after a signal to
    the ranks it printed "local job finished OK" and exited 0 for a run stopped at step 3 of 300."""
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/smoke.yaml", "--local",
           f"trainer.output_dir={tmp_path}/out", f"slurm.log_dir={tmp_path}/logs/%j",
           "trainer.smoke.steps=300", "trainer.smoke.step_seconds=0.1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        for line in proc.stdout:  # wait until rank 0 is stepping
            seen += line
            if "smoke step 3/" in line:
                break
        if to == "ranks":
            subprocess.run(["pkill", f"-{sig}", "-f", f"verl_hpc.job {tmp_path}"], check=True)
        else:
            proc.send_signal(getattr(signal, f"SIG{sig}"))
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + getattr(signal, f"SIG{sig}"), seen + out  # 140, 143
    result = json.loads((tmp_path / "out" / "smoke_result.json").read_text())
    assert result["steps"] < 300
    # every rank stopped at the same step on the signal; on a loaded machine the signal can reach
    # one rank only after the others agreed on theirs, so its own record may lag: its log says it
    assert all(x["stopped_on"] == f"SIG{sig}" and x["steps"] == result["steps"] for x in result["ranks"]), result
    logs = sorted((tmp_path / "logs").glob("**/stderr.log"))
    assert len(logs) == 2 and all(f"received SIG{sig}" in f.read_text() for f in logs), logs
    # the submitter's last line: where the job stopped, why, and how to start it again (the smoke
    # job writes no checkpoint)
    last = out.strip().splitlines()[-1]
    rerun = f"start again with: python -m verl_hpc.submit configs/smoke.yaml --local"
    if to == "ranks":
        assert last.startswith(f"[submit] the job stopped early at step {result['steps']} of 300: SIG{sig}"), last
        assert "reached its ranks, not this submitter" in last and rerun in last, last
    else:
        assert last.startswith(f"[submit] stopped by SIG{sig} at step {result['steps']} before any checkpoint; "
                               + rerun), last
    assert "finished OK" not in out, out[-3000:]


def test_signals_at_the_end_leave_the_job_as_it_ended(tmp_path):
    """Issue 93: SIGUSR2 to a rank that had saved its last step and printed its result killed it
    (exit -12: Python puts the handler back to the default as it exits), and the submitter said
    "local job FAILED" and exited 1; one in the last step made it "stopped early at step 6 of 6"
    (140); SIGTERM to the submitter after "local job finished OK" ended it with 143 and no line.
    The ranks get SIGUSR2 every 10 ms from their fifth step's line until they are gone, the
    submitter SIGTERM from its result line until it is gone, so some land wherever an exit is
    slow. Whenever they land, the exit code and the last line say what happened: finished (all 6
    steps: 0), or stopped early at the step the result names (140)."""
    import psutil

    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/smoke.yaml", "--local", "slurm.tasks_per_node=2",
           f"trainer.output_dir={tmp_path}/out", f"slurm.log_dir={tmp_path}/logs/%j", "trainer.smoke.steps=6",
           "trainer.smoke.step_seconds=0.3"]
    # one stream, in order: rank 0's log (its steps), the submitter's lines, then a late signal's
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks, rank_signals = [], None

    def keep_signalling(pids, sig):  # every 10 ms until each is gone
        while True:
            alive = [p for p in pids if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                return
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            time.sleep(0.01)

    try:
        seen = ""
        for line in proc.stdout:
            seen += line
            if "smoke step 1/6" in line:  # the ranks are up (and stay up for five more steps)
                ranks = [c for c in psutil.Process(proc.pid).children() if "verl_hpc.job" in c.cmdline()]
            if "smoke step 5/6" in line and rank_signals is None:  # past that step's agreement, as a rule
                rank_signals = threading.Thread(target=keep_signalling, args=(ranks, signal.SIGUSR2))
                rank_signals.start()
            if line.startswith("[submit] ") and not line.startswith(("[submit] starting", "[submit] SIGUSR2")):
                keep_signalling([psutil.Process(proc.pid)], signal.SIGTERM)  # its result is printed
                break
        after, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert len(ranks) == 2 and rank_signals is not None, seen
    rank_signals.join(timeout=60)
    steps = json.loads((tmp_path / "out" / "smoke_result.json").read_text())["steps"]
    result = seen.strip().splitlines()[-1]
    if steps == 6:  # finished: not 1 for a rank killed by SIGUSR2, 140 for a stop "at step 6 of 6", 143
        assert proc.returncode == 0 and result.startswith("[submit] local job finished OK"), seen + after
        words = "the job had already finished OK"
    else:  # the first SIGUSR2 came before the fifth step's agreement: a stop there, as it should be
        assert proc.returncode == 140 and result.startswith(f"[submit] the job stopped early at step {steps} of 6: "
                                                            "SIGUSR2"), seen + after
        words = "the job had already stopped (the line above)"
    # the submitter took one of the SIGTERMs before it was gone, or was gone before the first came
    assert after in ("", f"[submit] SIGTERM came after {words}: nothing left to stop\n"), seen + after


# > the start-up skew of the two smoke ranks (rendezvous shares this timeout): the same light program
# started at once, they were up within the same second at load 10 on 2 cores (it was 30 s)
WEDGED_TIMEOUT_S = 15
WEDGED = "test_wedged_rank_is_caught_by_the_collective_timeout"


@pytest.fixture(scope="module", autouse=True)
def wedged_job(request, tmp_path_factory, smoke_job, failure_after):
    """The wedged-rank job, started at the module's first test where its test is selected:
    `failure_after` (the moment rank 1 hangs, the job's end, its output) runs in a thread while
    the module's other tests run, and the test collects what it found."""
    if not any(item.name == WEDGED and item.module is request.module for item in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("wedged")
    # rank 1 stays alive but stops answering: only the collective timeout can end this job
    proc = smoke_job(tmp, "trainer.smoke.steps=200", "trainer.smoke.fail_rank=1",
                     "trainer.smoke.fail_at_step=2", "trainer.smoke.fail_mode=hang",
                     f"trainer.collective_timeout_s={WEDGED_TIMEOUT_S}")
    outcome = {}

    def watch():
        try:
            outcome["result"] = failure_after(proc, tmp / "logs", "**/1/stderr.log", "hangs on purpose")
        except BaseException as e:  # noqa: BLE001 - raised again in the test
            outcome["error"] = e

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield proc, watcher, outcome
    proc.kill()  # failure_after kills it too; this covers a test that never collected it
    watcher.join(timeout=30)


def test_wedged_rank_is_caught_by_the_collective_timeout(wedged_job):
    proc, watcher, outcome = wedged_job
    watcher.join(timeout=300)
    assert not watcher.is_alive(), "the wedged-rank job neither hung nor ended within 300 s"
    if "error" in outcome:
        raise outcome["error"]
    _, err, elapsed = outcome["result"]
    assert proc.returncode != 0
    # the collective timeout + the launcher's 30 s grace for the wedged rank (launcher/local.py), + slack
    assert elapsed < WEDGED_TIMEOUT_S + 30 + 30, f"took {elapsed:.0f}s to give up on a wedged rank"
    assert "rank 0 exited with code 1" in err, err
    log = Path(err.split("rank 0 exited with code 1")[1].split("log: ")[1].split()[0]).read_text()
    assert "Timed out" in log and f"collective timeout {WEDGED_TIMEOUT_S}s" in log, log[-2000:]
