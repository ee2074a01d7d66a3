"""SIGTERM, Ctrl-C and SIGUSR2 to a local job's submitter end it as Slurm would (docs/signals.md).

    with LocalStop() as stop:            # around torch's elastic launcher
        elastic_launch(...)(...)
    note = stop_note(notes)              # the ranks' word: stopped on a signal (theirs or ours), or nothing left
    if note and note.signal: print(stop_line(stop, ckpt, rerun, note) if stop.signum else
                                   early_stop_line(note, ckpt, rerun))   # launcher/local.py's conclude

torch's elastic agent turns SIGTERM/SIGINT into an exception in the launcher, signals the ranks,
kills them 30 s later and leaves the exception's traceback: a rank still saving its checkpoint
then, or one told by Ctrl-C (a KeyboardInterrupt) mid-save, loses that step's checkpoint. So the
launcher keeps these two signals to itself (LaunchConfig.signals_to_handle) and this class; SIGUSR2
(Slurm's warning signal: checkpoint and come back), which torch does not handle and which would
end the submitter at once, with the ranks stopping without a checkpoint once they see their
launcher gone (runtime/orphans.py), is this class's too:
- first signal: sends it on to every rank (each runs in its own session, so a terminal's Ctrl-C
  reaches only the submitter), which records it, checkpoints at the end of the step in flight
  and exits 0 (runtime/signals.py; a local job is never requeued); the launcher waits for that
  as for any end of the ranks;
- second signal: abandons at once, killing the ranks. `latest` moves only after a complete save
  (checkpoint/publish.py), so it still names the last complete checkpoint. A second SIGUSR2 only
  repeats the first: it asks for the checkpoint that abandoning would lose.

The exit code is the shell's for a death by that signal, 128 + its number (143, 130, 140 for
SIGUSR2), so a script tells a stopped job from one that finished (0) or failed (1, or an error
class's code), and a warning-signal stop (come back: resume) from a cancel.

A signal sent to the ranks themselves (`kill -USR2 <rank pid>`, a cluster tool) stops them the same
way without the submitter hearing of it: each rank that stopped on an agreed signal leaves a note
(`note_stop`, called by job.py) in the folder the submitter names in STOP_NOTES, and the submitter,
seeing every rank exit 0, reads it (`stop_note`) and ends as it would for its own signal: where
the ranks stopped, why, how to resume, 128 + the signal's number. Without the note it would say
"finished OK" and exit 0 for a run stopped at step 3 of 12. A run resumed at its last step (run
again once finished) leaves a note too, without a signal: the submitter then says there was
nothing left to do. A signal that reached the ranks after their last step stops nothing: they
leave no note, and the submitter says the job finished (0), as it did.

The forwarding runs on a thread, not in the handler: ranks still starting when the signal comes
are signalled once they exist, and the handler itself only records (it may interrupt a print).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import psutil

from verl_hpc.errors import VerlHpcError

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
RANK_ENTRY = "verl_hpc.job"  # what the launcher starts on each rank (launcher/local.py)
STOP_NOTES = "VERL_HPC_STOP_NOTES"  # the folder the local launcher's ranks leave their stop notes in


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
        elif signum != signal.SIGUSR2:  # the warning signal again asks for the same checkpoint
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
            local = " (a local job is not requeued: resume it with the command this ends with)" \
                if self.signum == signal.SIGUSR2 else ""
            print(f"[submit] {name}: the ranks checkpoint at the end of the step in flight, then stop{local}; "
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


def stop_line(stop: LocalStop, checkpoint_dir: str | os.PathLike | None, rerun: str,
              note: Optional[StopNote] = None) -> str:
    """The one line the submitter ends with after a signal: where it stopped and how to go on
    (note: the ranks' own word on where they stopped, for a program that writes no checkpoint)."""
    name = signal.Signals(stop.signum).name
    how = " (a second signal abandoned the step in flight)" if stop.abandoned else ""
    latest = _latest(checkpoint_dir)
    if latest is None:
        at = f" at step {note.step}" if note is not None and note.step is not None and not stop.abandoned else ""
        return f"[submit] stopped by {name}{how}{at} before any checkpoint; start again with: {rerun}"
    if isinstance(latest, str):
        return f"[submit] stopped by {name}{how}; {latest}; see: python -m verl_hpc.checkpoint inspect {checkpoint_dir}"
    if stop.abandoned:
        return (f"[submit] stopped by {name}{how}; latest checkpoint {latest} (step {_step(latest)}); "
                f"resume with: {rerun}")
    return f"[submit] stopped by {name} at step {_step(latest)}; checkpoint {latest}; resume with: {rerun}"


class StopNote(NamedTuple):
    """What a rank tells the submitter (its note, written by note_stop): the signal it stopped on,
    or None where it was resumed at the run's last step (`resumed_from`) and had nothing to do."""
    signal: Optional[str]
    step: Optional[int]
    total_steps: Optional[int]
    rank: int
    resumed_from: Optional[int] = None

    @property
    def exit_code(self) -> int:
        return 128 + int(signal.Signals[self.signal]) if self.signal else 0


def open_notes(log_dir: Path) -> Path:
    """The launcher, before the ranks start: an empty notes folder, named to the ranks in STOP_NOTES."""
    folder = Path(log_dir) / "stopped"
    shutil.rmtree(folder, ignore_errors=True)  # a log folder used again must not hold an old run's note
    folder.mkdir(parents=True)
    os.environ[STOP_NOTES] = str(folder)
    return folder


def note_stop(rank: int, agreed_signal: Optional[str], summary) -> None:
    """A rank, once its program returned: if it stopped on a signal every rank agreed on, or was
    resumed at the run's last step (nothing left to do), and its launcher is the local submitter
    (STOP_NOTES), say so there. Elsewhere (Slurm, torchrun) nothing."""
    folder = os.environ.get(STOP_NOTES)
    summary = summary if isinstance(summary, dict) else {}
    if not folder or not (agreed_signal or nothing_left(summary)):
        return
    note = {"signal": agreed_signal, "step": summary.get("steps"), "total_steps": summary.get("total_steps"),
            "resumed_from": summary.get("resumed_from")}
    tmp = Path(folder) / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(note))
    os.replace(tmp, Path(folder) / f"rank{rank}.json")  # whole or absent


def stop_note(folder: Path) -> Optional[StopNote]:
    """The note of the lowest rank that left one (None: no rank stopped on a signal)."""
    notes = sorted(Path(folder).glob("rank*.json"), key=lambda f: int(f.stem[4:]))
    if not notes:
        return None
    note = json.loads(notes[0].read_text())
    return StopNote(note["signal"], note.get("step"), note.get("total_steps"), int(notes[0].stem[4:]),
                    note.get("resumed_from"))


def nothing_left(summary: dict) -> bool:
    """A run resumed at its last step (a training program's summary: resumed_from, total_steps)."""
    start, total = summary.get("resumed_from"), summary.get("total_steps")
    return isinstance(start, int) and isinstance(total, int) and 0 < total <= start


def nothing_left_line(note: StopNote, checkpoint_dir, log_dir) -> str:
    """The submitter's last line for a run that had already reached its last step."""
    latest = _latest(checkpoint_dir)
    at = f"checkpoint {latest}" if isinstance(latest, Path) else f"step {note.resumed_from}"
    return (f"[submit] local job finished OK: nothing left to do, it resumed from {at}, the run's last "
            f"(step {note.resumed_from} of {note.total_steps}); logs in {log_dir}")


def early_stop_line(note: StopNote, checkpoint_dir: str | os.PathLike | None, rerun: str) -> str:
    """The submitter's last line when the ranks stopped on a signal it did not receive itself."""
    at = "" if note.step is None else f" at step {note.step}" + (f" of {note.total_steps}" if note.total_steps else "")
    warning = note.signal == "SIGUSR2"
    why = (f"[submit] the job stopped early{at}: {note.signal}{' (Slurm warning signal)' if warning else ''} "
           f"reached its ranks, not this submitter{'; a local job is not requeued' if warning else ''}")
    latest = _latest(checkpoint_dir)
    if latest is None:
        return f"{why}; no checkpoint; start again with: {rerun}"
    if isinstance(latest, str):
        return f"{why}; {latest}; see: python -m verl_hpc.checkpoint inspect {checkpoint_dir}"
    return f"{why}; checkpoint {latest} (step {_step(latest)}); resume with: {rerun}"


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
