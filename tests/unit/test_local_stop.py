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
