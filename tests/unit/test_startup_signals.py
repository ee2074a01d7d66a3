"""SIGTERM, Ctrl-C and SIGUSR2 in a program's start-up, before it has started anything: the submitter and
the planner end with one line on stderr and 143 / 130 / 140, no traceback; a rank keeps the signal for
its preemption flag and stops at its first step boundary (launcher/early_signals.py).

Each is a real process reading its config from a named pipe: opening the pipe's other end returns
exactly when the program opens its config, a known moment of its start-up (its imports done, its
files not yet checked), and the signal lands while it waits there."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_hpc.runtime.signals import DEFAULT_SIGNALS

REPO = Path(__file__).resolve().parents[2]
SMOKE = """trainer:
  job: smoke
  output_dir: {out}
  smoke: {{steps: 50, step_seconds: 0.2}}
parallel: {{backend: gloo}}
slurm: {{tasks_per_node: 1, gpus_per_node: 0}}
"""


def start_reading(tmp_path, *program):
    """`python -m <program> PIPE` in a session of its own, once it has opened PIPE (its config);
    returns (process, the pipe's write end)."""
    pipe = tmp_path / "job.yaml"
    os.mkfifo(pipe)
    proc = subprocess.Popen([sys.executable, "-m", *program[:1], str(pipe), *program[1:]], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120  # its imports, on a loaded machine
    while True:
        try:  # non-blocking: fails (ENXIO) until the program has opened the pipe to read
            return proc, os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{program[0]} never opened its config: {proc.communicate()}") from None
            time.sleep(0.05)


def send(proc, sig):
    if sig == signal.SIGINT:  # Ctrl-C: the terminal signals the whole foreground process group
        os.killpg(proc.pid, sig)
    else:  # kill PID
        proc.send_signal(sig)


@pytest.mark.parametrize("program, line", [
    (("verl_hpc.submit", "--local"), "[submit] stopped by {} before any rank started; nothing was submitted\n"),
    (("verl_hpc.plan",), "[plan] stopped by {} before the plan was complete\n"),
], ids=["submit", "plan"])
# SIGUSR2, Slurm's warning signal, ended both silently with 140 (issue 83, item 4)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2], ids=["SIGTERM", "SIGINT", "SIGUSR2"])
@pytest.mark.heavy
def test_a_signal_in_the_start_up_ends_it_with_one_line(terminal_sigint, tmp_path, program, line, sig):
    proc, pipe = start_reading(tmp_path, *program)
    try:
        send(proc, sig)
        # The kernel may hand a process's signal to any of its threads (torch's import starts some):
        # then the main thread, blocked reading the empty pipe, is not interrupted, and Python runs
        # the handler only once that read returns. A real config file's read returns at once; here
        # the pipe's end (EOF) stands for that. The handler then runs before anything else.
        time.sleep(0.2)
        os.close(pipe)
        pipe = None
        out, err = proc.communicate(timeout=60)
    finally:
        if pipe is not None:
            os.close(pipe)
        proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, err)  # 143, 130, 140: a stop, as the shell reports one
    assert err == line.format(sig.name), err


@pytest.mark.heavy
def test_a_rank_keeps_a_signal_of_its_start_up_and_stops_at_its_first_step(terminal_sigint, tmp_path):
    out = tmp_path / "out"
    proc, pipe = start_reading(tmp_path, "verl_hpc.job")
    try:
        send(proc, signal.SIGINT)  # while it reads its config: no flag of its own yet
        time.sleep(0.5)  # handled while it still waits for its config
        os.write(pipe, SMOKE.format(out=out).encode())
    finally:
        os.close(pipe)  # the config ends here
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    result = json.loads((out / "smoke_result.json").read_text())
    assert result["ranks"][0]["signal"] == "SIGINT" and result["steps"] == 1, result
    assert "received SIGINT: will checkpoint at the next step boundary" in err, err[-3000:]


def test_a_rank_keeps_the_signals_its_flag_takes():
    from verl_hpc.launcher import early_signals

    assert set(early_signals.RANK_SIGNALS) == set(DEFAULT_SIGNALS)


# After the result: the submitter's late signal (early_signals.outcome / end) and a rank past its
# last step (early_signals.ignore), each as a small program of its own (stdlib and early_signals
# only: a tenth of a second). Issue 93: SIGTERM to the submitter after "local job finished OK" ended
# it with 143 and no line, and SIGUSR2 to a rank that had written its result killed it (-12).
LATE = """
import atexit, os, signal, sys, time
from verl_hpc.launcher import early_signals

class AtTeardown:  # freed as the interpreter tears its modules down, after its own exit handlers
    def __del__(self):
        os.kill(os.getpid(), signal.{sig})
        time.sleep(0.5)

keep = AtTeardown()
{setup}
print("result printed", flush=True)
{wait}
"""
SUBMITTER = """early_signals.install("submit", "before any rank started; nothing was submitted")
early_signals.outcome(0, "the job had already finished OK")"""


def run_late(sig, setup, wait, *, signal_it=False):
    proc = subprocess.Popen([sys.executable, "-c", LATE.format(sig=sig.name, setup=setup, wait=wait)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "result printed\n", proc.communicate()
        if signal_it:  # while it waits for its stdin (the submitter printing its result, a rank its end)
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)  # stdin closed: it goes on to its end
    finally:
        proc.kill()
    return proc.returncode, err


def test_a_signal_after_the_result_says_so_and_exits_with_the_result():
    code, err = run_late(signal.SIGTERM, SUBMITTER, "sys.stdin.read()", signal_it=True)
    assert (code, err) == (0, "[submit] SIGTERM came after the job had already finished OK: nothing left to stop\n")


def test_a_signal_in_the_exit_handlers_says_so_and_one_in_the_teardown_cannot_come():
    """Python puts handled signals back to the default before it tears the modules down (half a
    second for torch's): end() runs the exit handlers with the handler still there, then leaves
    without the teardown, where a SIGTERM killed the finished submitter (-15) without a word."""
    code, err = run_late(signal.SIGTERM, SUBMITTER + "\natexit.register(os.kill, os.getpid(), signal.SIGTERM)",
                         "early_signals.end(0)")
    assert (code, err) == (0, "[submit] SIGTERM came after the job had already finished OK: nothing left to stop\n")
    code, err = run_late(signal.SIGTERM, SUBMITTER, "early_signals.end(0)")  # AtTeardown's signal
    assert (code, err) == (0, "")


def test_a_rank_past_its_last_step_ignores_the_signals_to_its_end():
    code, err = run_late(signal.SIGUSR2, "early_signals.keep()\nearly_signals.ignore()", "sys.stdin.read()",
                         signal_it=True)
    assert (code, err) == (0, "")  # a handled SIGUSR2 would have come back as the default in AtTeardown: -12
