"""A rank's heartbeat: a daemon thread rewrites one line in a file its restart supervisor watches.

    heartbeat.start(rank, timeout_s, checkpoint_dir)   # verl_hpc/job.py: beats where
                                                       # VERL_HPC_HEARTBEAT_DIR says, else nothing
    heartbeat.at_step(step)      # the trainer, at each step's start: the step goes into the beat

The beats come from a thread, not from the training loop: a rank waiting in a long collective, or
generating for minutes, still beats. What stops them is a process that no longer runs Python at
all: one holding the GIL in a C call that never returns, one stopped (SIGSTOP, a frozen cgroup) or
stuck in the kernel (a dead file system mount), one on a node that is gone. Such a rank escapes its
stage watchdog, a thread of the same process (runtime/watchdog.py); a rank stuck in Python code
outside collectives keeps beating, and that watchdog ends it (exit 16). The supervisor's side,
which reads these files and kills a silent rank: launcher/heartbeat.py.

File `<folder>/rank<N>`: `<beats> <step> <pid> <node> <timeout_s>`, rewritten in place; step -1 once
the rank's program has ended (`stop`): a rank that ended is silent, not stuck. The
timeout is the rank's own trainer.heartbeat_timeout_s: the config says it once, and the
supervisor, which never reads the config (the batch host may not have the ranks' packages), learns
it from the beats, as it learns checkpoint.dir from rank 0's `<folder>/job.json` (the step a
restart resumes from, for its line). Standard library only; launcher/heartbeat.py reads the same
names and format (a unit test writes here and reads there).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Optional

ENV = "VERL_HPC_HEARTBEAT_DIR"  # where the ranks beat (set by the supervisor for each launch)
JOB = "job.json"  # rank 0's word on the job to its supervisor: {checkpoint_dir}
_state = {"step": 0, "beats": 0, "path": "", "host": "", "timeout": 0.0}  # this rank's beat (start, at_step)
_lock = threading.Lock()  # the beat thread and at_step write the same file


def interval_for(timeout_s: float) -> float:
    """Seconds between beats for a timeout: five beats per timeout, at least 0.2 s apart, at most
    30 (a thousand ranks beating every 30 s is 33 small writes a second)."""
    return min(30.0, max(0.2, float(timeout_s) / 5.0))


def path_of(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}")


def start(rank: int, timeout_s: float, checkpoint_dir: str = "", environ=None) -> Optional[threading.Thread]:
    """Beat for `rank` where a supervisor watches (VERL_HPC_HEARTBEAT_DIR), timeout_s apart / 5;
    None where nobody watches or timeout_s is 0. Rank 0 also tells it checkpoint.dir."""
    environ = os.environ if environ is None else environ
    folder = environ.get(ENV, "")
    if not folder:
        return None
    if rank == 0:
        tmp = os.path.join(folder, ".%s.%d" % (JOB, os.getpid()))
        with open(tmp, "w") as f:
            json.dump({"checkpoint_dir": os.path.abspath(checkpoint_dir) if checkpoint_dir else ""}, f)
        os.replace(tmp, os.path.join(folder, JOB))
    if not timeout_s or timeout_s <= 0:
        return None
    interval = interval_for(timeout_s)
    # the node as Slurm names it (srun's lines, --exclude), where Slurm started the rank
    host = environ.get("SLURMD_NODENAME") or socket.gethostname()
    _state.update(path=path_of(folder, rank), host=host, timeout=float(timeout_s), step=0, stopped=False)
    beat()  # before the thread: a rank is watched from its first beat on

    def run() -> None:
        while True:
            time.sleep(interval)
            if _state.get("stopped"):
                return
            try:
                beat()
            except OSError:  # a full or flaky file system: the supervisor sees silence, which is the truth
                pass

    thread = threading.Thread(target=run, name="verl_hpc-heartbeat", daemon=True)
    thread.start()
    return thread


def stop() -> None:
    """The rank's program has ended (returned or raised): one last beat saying so; the thread stops."""
    _state["stopped"] = True
    _beat_now(-1)


def at_step(step: int) -> None:
    """The step the rank starts now: beaten at once, so that a rank dying in it is named with it."""
    _beat_now(int(step))


def _beat_now(step: int) -> None:
    """The step into the beat, and a beat at once where the rank beats at all."""
    _state["step"] = step
    if _state["path"]:
        try:
            beat()
        except OSError:  # as in the thread: silence is what the supervisor then sees
            pass


def beat() -> None:
    """One beat: the line rewritten in place (one write of a few dozen bytes, no rename: a reader
    sees the old line or the new one)."""
    with _lock:
        _state["beats"] += 1
        line = ("%d %d %d %s %g\n" % (_state["beats"], _state["step"], os.getpid(), _state["host"],
                                        _state["timeout"])).encode()
        fd = os.open(_state["path"], os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, len(line))
            os.pwrite(fd, line, 0)
        finally:
            os.close(fd)
