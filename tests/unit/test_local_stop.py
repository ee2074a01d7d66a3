"""Ctrl-C and SIGTERM on a local job, the parts that run in one process: a rank's flag takes SIGINT
as a stop without cutting a save short, and the submitter passes the first signal on to the ranks
and kills them on a second (the whole job: tests/dist/test_local_signals.py)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from verl_hpc.checkpoint import ShardedTensor, find_latest, save_checkpoint
from verl_hpc.checkpoint import save as save_module
from verl_hpc.launcher.local_stop import LocalStop
from verl_hpc.runtime.signals import DEFAULT_SIGNALS, PreemptionFlag


@pytest.fixture
def flag():
    before = {s: signal.getsignal(s) for s in DEFAULT_SIGNALS + (signal.SIGINT,)}
    yield PreemptionFlag().install()
    for s, handler in before.items():
        signal.signal(s, handler)


def test_ctrl_c_during_a_save_is_recorded_and_the_save_completes(flag, tmp_path, monkeypatch):
    real = save_module.write_rank_file

    def interrupted(*a, **k):  # Ctrl-C lands while the rank file is being written
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(save_module, "write_rank_file", interrupted)
    try:
        path = save_checkpoint(tmp_path, 3, [ShardedTensor("w", torch.ones(8))])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C cut the checkpoint save short")
    assert find_latest(tmp_path) == path
    assert flag.is_set() and flag.signal_name == "SIGINT"
    assert flag.agreed() and flag.agreed_signal == "SIGINT"  # a stop, named as itself
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: the user does not want to wait
        os.kill(os.getpid(), signal.SIGINT)


FAKE_RANK = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda s, f: open(sys.argv[2], "a").write("TERM\\n"))
open(sys.argv[2], "a").write("up\\n")
while True:
    time.sleep(0.05)
"""


def wait_for(path, text, timeout=20):
    end = time.time() + timeout
    while time.time() < end:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never in {path}")


def test_submitter_passes_the_first_signal_on_and_kills_on_the_second(terminal_sigint, tmp_path):
    said = tmp_path / "rank.txt"
    # named as the submitter's ranks are (`python -u -m verl_hpc.job CONFIG`), in its own session
    rank = subprocess.Popen([sys.executable, "-c", FAKE_RANK, "verl_hpc.job", str(said)], start_new_session=True)
    try:
        wait_for(said, "up")
        with LocalStop() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(said, "TERM")  # the rank was told, and is still running its step
            assert rank.poll() is None and not stop.abandoned
            os.kill(os.getpid(), signal.SIGINT)
            assert rank.wait(timeout=20) == -signal.SIGKILL
        assert stop.signum == signal.SIGTERM and stop.abandoned and stop.exit_code == 143
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        rank.kill()


FAKE_RANK_USR2 = """
import signal, sys, time
for s, name in ((signal.SIGTERM, "TERM"), (signal.SIGUSR2, "USR2")):
    signal.signal(s, lambda sig, f, name=name: open(sys.argv[2], "a").write(name + "\\n"))
open(sys.argv[2], "a").write("up\\n")
while True:
    time.sleep(0.05)
"""


def test_the_warning_signal_is_passed_on_once_and_a_second_one_abandons_nothing(tmp_path):
    """SIGUSR2 (issue 83, item 4): torch's launcher leaves it alone, so it ended the submitter at
    once (140, silent) and the ranks, their launcher gone, stopped without a checkpoint. It is
    passed on as SIGTERM is; sent again it asks for the same checkpoint, so it abandons nothing
    (a SIGTERM after it does)."""
    said = tmp_path / "rank.txt"
    rank = subprocess.Popen([sys.executable, "-c", FAKE_RANK_USR2, "verl_hpc.job", str(said)], start_new_session=True)
    mine = signal.signal(signal.SIGUSR2, lambda *a: None)  # a stray SIGUSR2 must not end pytest itself
    try:
        wait_for(said, "up")
        with LocalStop() as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            wait_for(said, "USR2")
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.5)  # the forwarding thread wakes every 0.2 s
            assert rank.poll() is None and not stop.abandoned
            assert said.read_text().count("USR2") == 1  # each rank is told once
            os.kill(os.getpid(), signal.SIGTERM)
            assert rank.wait(timeout=20) == -signal.SIGKILL
        assert stop.signum == signal.SIGUSR2 and stop.abandoned and stop.exit_code == 140
        assert signal.getsignal(signal.SIGUSR2) is not stop._handle  # put back
    finally:
        signal.signal(signal.SIGUSR2, mine)
        rank.kill()


def test_a_rank_notes_an_agreed_stop_only_for_the_local_submitter(tmp_path, monkeypatch):
    """The note a rank stopped by a signal leaves for the local submitter (launcher/local_stop.py):
    only with the submitter's folder named, only on an agreed signal; the lowest rank's is read."""
    from verl_hpc.launcher.local_stop import STOP_NOTES, early_stop_line, note_stop, open_notes, stop_note

    monkeypatch.setenv(STOP_NOTES, "")  # put back as it was at the end (open_notes sets it)
    monkeypatch.delenv(STOP_NOTES)
    note_stop(0, "SIGUSR2", {"steps": 3})  # not started by the local submitter: nothing, nowhere
    folder = open_notes(tmp_path / "logs")
    assert os.environ[STOP_NOTES] == str(folder)
    note_stop(0, None, {"steps": 12, "total_steps": 12})  # finished: no note
    assert stop_note(folder) is None
    note_stop(10, "SIGUSR2", {"steps": 3, "total_steps": 12})
    note_stop(2, "SIGUSR2", {"steps": 3, "total_steps": 12})
    note = stop_note(folder)
    assert (note.rank, note.signal, note.step, note.total_steps, note.exit_code) == (2, "SIGUSR2", 3, 12, 140)
    line = early_stop_line(note, tmp_path / "ck", "python -m verl_hpc.submit x.yaml --local")
    assert line == ("[submit] the job stopped early at step 3 of 12: SIGUSR2 (Slurm warning signal) reached its "
                    "ranks, not this submitter; a local job is not requeued; no checkpoint; start again with: "
                    "python -m verl_hpc.submit x.yaml --local"), line
    assert stop_note(open_notes(tmp_path / "logs")) is None  # the folder used again starts empty


def test_the_last_line_follows_what_the_ranks_did_not_when_the_signal_came(tmp_path, monkeypatch, capsys):
    """Issue 93: the submitter decided by its own signal alone, so a SIGTERM passed on to ranks that
    had already reached their last step ended a finished job with `stopped by SIGTERM` and 143.
    Now the ranks' notes decide: a stop on a signal leaves one, a run to the end none, and a run
    resumed at its last step one that says there was nothing left to do."""
    import types

    from verl_hpc.launcher.local import conclude
    from verl_hpc.launcher.local_stop import STOP_NOTES, note_stop, open_notes, stop_note

    monkeypatch.setenv(STOP_NOTES, "")  # put back as it was at the end (open_notes sets it)
    plan = types.SimpleNamespace(log_dir=tmp_path / "logs", rollout_ranks=0)
    rerun = "python -m verl_hpc.submit x.yaml --local"
    told = types.SimpleNamespace(signum=signal.SIGTERM, abandoned=False, exit_code=143)
    untold = types.SimpleNamespace(signum=None, abandoned=False, exit_code=0)

    def last_line(stop, note):
        code, words = conclude(plan, stop, None, note, tmp_path / "ck", rerun)
        return code, words, capsys.readouterr().out.strip().splitlines()[-1]

    folder = open_notes(plan.log_dir)
    note_stop(0, None, {"steps": 6, "total_steps": 6, "resumed_from": 0})  # ran to its end: no note
    assert stop_note(folder) is None
    assert last_line(told, None) == (0, "the job had already finished OK", (
        f"[submit] local job finished OK (SIGTERM came too late to stop it: the ranks had reached their last "
        f"step); logs in {plan.log_dir}"))
    assert last_line(untold, None)[::2] == (0, f"[submit] local job finished OK; logs in {plan.log_dir}")

    note_stop(0, None, {"steps": 6, "total_steps": 6, "resumed_from": 6})  # run again once finished
    note = stop_note(folder)
    assert (note.signal, note.resumed_from, note.exit_code) == (None, 6, 0)
    assert last_line(told, note) == (0, "the job had already finished OK", (
        "[submit] local job finished OK: nothing left to do, it resumed from step 6, the run's last "
        f"(step 6 of 6); logs in {plan.log_dir}"))

    folder = open_notes(plan.log_dir)
    note_stop(0, "SIGTERM", {"steps": 3, "total_steps": 6, "resumed_from": 0})  # stopped early
    note = stop_note(folder)
    code, words, line = last_line(told, note)
    assert (code, words) == (143, "the job had already stopped (the line above)")
    assert line == f"[submit] stopped by SIGTERM at step 3 before any checkpoint; start again with: {rerun}", line
    code, _, line = last_line(untold, note)  # the signal went to the ranks themselves
    assert code == 143 and line.startswith("[submit] the job stopped early at step 3 of 6: SIGTERM reached"), line
