"""SIGTERM and Ctrl-C to a local job's submitter end it as a Slurm cancel would (docs/signals.md).

    with LocalStop() as stop:            # around torch's elastic launcher
        elastic_launch(...)(...)
    if stop.signum: print(stop_line(stop, checkpoint_dir, rerun)); return stop.exit_code

torch's elastic agent turns SIGTERM/SIGINT into an exception in the launcher, signals the ranks,
kills them 30 s later and leaves the exception's traceback: a rank still saving its checkpoint
then, or one told by Ctrl-C (a KeyboardInterrupt) mid-save, loses that step's checkpoint. So the
launcher keeps these two signals to itself (LaunchConfig.signals_to_handle) and this class:
- first signal: sends it on to every rank (each runs in its own session, so a terminal's Ctrl-C
  reaches only the submitter), which records it, checkpoints at the end of the step in flight
  and exits 0 (runtime/signals.py); the launcher waits for that as for any end of the ranks;
- second signal: abandons at once, killing the ranks. `latest` moves only after a complete save
  (checkpoint/publish.py), so it still names the last complete checkpoint.

The exit code is the shell's for a death by that signal, 128 + its number (143, 130), so a script
tells a stopped job from one that finished (0) or failed (1, or an error class's code).

The forwarding runs on a thread, not in the handler: ranks still starting when the signal comes
are signalled once they exist, and the handler itself only records (it may interrupt a print).
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import psutil

from verl_hpc.errors import VerlHpcError

SIGNALS = (signal.SIGTERM, signal.SIGINT)
RANK_ENTRY = "verl_hpc.job"  # what the launcher starts on each rank (launcher/local.py)


class LocalStop:
    def __init__(self, poll_s: float = 0.2) -> None:
        self.signum: int | None = None  # the first signal: what the ranks act on, the exit code
        self.abandoned = False  # a second signal came
        self.poll_s = poll_s
        self._wake = threading.Event()
        self._done = False
        self._sent: dict[int, int] = {}  # rank pid -> the last signal it was sent
        self._said: set = set()

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum) if self.signum else 0

    def __enter__(self) -> "LocalStop":
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        self._thread = threading.Thread(target=self._forward, name="verl_hpc-local-stop", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done = True
        self._wake.set()
        self._thread.join()
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        if self.signum is None:
            self.signum = signum
        else:
            self.abandoned = True
        self._wake.set()

    def _forward(self) -> None:
        while not self._done:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self.signum is not None and not self._done:
                self._tell_user()
                self._signal_ranks()

    def _tell_user(self) -> None:
        name = signal.Signals(self.signum).name
        if name not in self._said:
            self._said.add(name)
            print(f"[submit] {name}: the ranks checkpoint at the end of the step in flight, then stop; "
                  "a second Ctrl-C (or SIGTERM) abandons that step at once", flush=True)
        if self.abandoned and "abandon" not in self._said:
            self._said.add("abandon")
            print("[submit] second signal: abandoning the step in flight; ranks killed", flush=True)

    def _signal_ranks(self) -> None:
        """The first signal to each rank once; SIGKILL to each rank's process group (its own
        children, e.g. inference workers, too) after a second."""
        sig = signal.SIGKILL if self.abandoned else self.signum
        for pid in rank_pids():
            if self._sent.get(pid) == sig:
                continue
            try:
                if sig == signal.SIGKILL:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):  # it ended meanwhile
                continue
            self._sent[pid] = sig


def rank_pids() -> list[int]:
    """The rank processes the launcher started: this process's children running the job entry."""
    pids = []
    for child in psutil.Process().children():
        try:
            if RANK_ENTRY in child.cmdline():
                pids.append(child.pid)
        except psutil.Error:  # ended or became a zombie between listing and asking
            continue
    return pids


def stop_line(stop: LocalStop, checkpoint_dir: str | os.PathLike | None, rerun: str) -> str:
    """The one line the submitter ends with after a signal: where it stopped and how to go on."""
    name = signal.Signals(stop.signum).name
    how = " (a second signal abandoned the step in flight)" if stop.abandoned else ""
    latest = _latest(checkpoint_dir)
    if latest is None:
        return f"[submit] stopped by {name}{how} before any checkpoint; start again with: {rerun}"
    if isinstance(latest, str):
        return f"[submit] stopped by {name}{how}; {latest}; see: python -m verl_hpc.checkpoint inspect {checkpoint_dir}"
    if stop.abandoned:
        return (f"[submit] stopped by {name}{how}; latest checkpoint {latest} (step {_step(latest)}); "
                f"resume with: {rerun}")
    return f"[submit] stopped by {name} at step {_step(latest)}; checkpoint {latest}; resume with: {rerun}"


def _latest(checkpoint_dir) -> Path | str | None:
    """The checkpoint `latest` names, None without one, or what is wrong with it (a string)."""
    if not checkpoint_dir:
        return None
    from verl_hpc.checkpoint.index import find_latest

    try:
        return find_latest(checkpoint_dir)
    except VerlHpcError as err:
        return f"but {err}"


def _step(path: Path) -> int:
    from verl_hpc.checkpoint.publish import STEP_DIR

    return int(STEP_DIR.match(path.name).group(1))
