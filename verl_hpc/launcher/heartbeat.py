"""Heartbeats: every rank says it is alive in a file; its supervisor kills a rank whose file stops changing.

    heartbeat.start(rank, timeout_s, checkpoint_dir)   # a rank (verl_hpc/job.py): beats where
                                                       # VERL_HPC_HEARTBEAT_DIR says, else nothing
    heartbeat.at_step(step)      # the trainer, at each step's start: the step goes into the beat
    watch = Watch(folder)
    watch.silent()               # the supervisor (launcher/restart_loop.py, launcher/local_restarts.py)

The beats come from a daemon thread, not from the training loop: a rank waiting in a long
collective, or generating for minutes, still beats. What stops them is a process that no longer
runs Python at all: one holding the GIL in a C call that never returns, one stopped (SIGSTOP, a
frozen cgroup) or stuck in the kernel (a dead file system mount), one on a node that is gone. Such
a rank escapes its stage watchdog, a thread of the same process (runtime/watchdog.py); a rank
stuck in Python code outside collectives keeps beating, and that watchdog ends it (exit 16). The
other ranks would wait in their next collective for trainer.collective_timeout_s and then fail
with a timeout that names nobody; the supervisor instead kills the silent rank, names it, and
counts it as dead (an in-allocation restart: launcher/restarts.py).

File `<folder>/rank<N>`: `<beats> <step> <pid> <host> <timeout_s>`, rewritten in place. The
timeout is the rank's own trainer.heartbeat_timeout_s: the config says it once, and the
supervisor, which never reads the config (the batch host may not have the ranks' packages), learns
it from the beats, as it learns checkpoint.dir from rank 0's `<folder>/job.json` (the step a
restart resumes from, for its line). The supervisor compares contents, not times: its clock and a
rank's node's clock need not agree, and a shared file system's modification times are its
server's. Standard library only (Python >= 3.8): the Slurm supervisor imports this on the batch
host with whatever python3 is there.
"""
import json
import os
import socket
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

ENV = "VERL_HPC_HEARTBEAT_DIR"  # where the ranks beat (set by the supervisor for each launch)
JOB = "job.json"  # rank 0's word on the job to its supervisor: {checkpoint_dir}
_state = {"step": 0, "beats": 0, "path": "", "host": "", "timeout": 0.0}  # this rank's beat (start, at_step)
_lock = threading.Lock()  # the beat thread and at_step write the same file


class Beat(NamedTuple):
    beats: int
    step: int
    pid: int
    host: str
    timeout_s: float = 0.0  # the rank's trainer.heartbeat_timeout_s


def interval_for(timeout_s: float) -> float:
    """Seconds between beats for a supervisor's timeout: five beats per timeout, at least 0.2 s
    apart, at most 30 (a thousand ranks beating every 30 s is 33 small writes a second)."""
    return min(30.0, max(0.2, float(timeout_s) / 5.0))


def path_of(folder: str, rank: int) -> str:
    return os.path.join(folder, "rank%d" % rank)


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
    _state.update(path=path_of(folder, rank), host=host, timeout=float(timeout_s))
    beat()  # before the thread: a rank is watched from its first beat on

    def run() -> None:
        while True:
            time.sleep(interval)
            try:
                beat()
            except OSError:  # a full or flaky file system: the supervisor sees silence, which is the truth
                pass

    thread = threading.Thread(target=run, name="verl_hpc-heartbeat", daemon=True)
    thread.start()
    return thread


def job_facts(folder: str) -> dict:
    """What rank 0 told its supervisor ({} before it did)."""
    try:
        with open(os.path.join(folder, JOB)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def at_step(step: int) -> None:
    """The step the rank starts now: beaten at once, so that a rank dying in it is named with it."""
    _state["step"] = int(step)
    if _state["path"]:
        try:
            beat()
        except OSError:
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


def read(path: str) -> Optional[Beat]:
    try:
        with open(path) as f:
            parts = f.read().split()
        return Beat(int(parts[0]), int(parts[1]), int(parts[2]), parts[3] if len(parts) > 3 else "",
                    float(parts[4]) if len(parts) > 4 else 0.0)
    except (OSError, ValueError, IndexError):  # not there yet, or caught between truncate and write
        return None


class Watch:
    """The supervisor's side: the ranks whose beat has not changed for their timeout (the one each
    beat carries; `timeout_s` where a beat carries none) by the supervisor's own clock. A rank is
    watched from its first beat (a rank still importing is not); each silent rank is reported once."""

    def __init__(self, folder: str, timeout_s: float = 0.0, clock=time.monotonic):
        self.folder, self.timeout_s, self.clock = folder, float(timeout_s), clock
        self._seen: Dict[int, Tuple[Beat, float]] = {}  # rank -> (its last beat, when it changed)
        self._reported: set = set()

    def poll_s(self) -> float:
        """How often to look: a fifth of the shortest timeout the beats carry, 0.5-5 s (1 s before any beat)."""
        limits = [b.timeout_s for b, _ in self._seen.values() if b.timeout_s > 0] or [self.timeout_s or 5.0]
        return max(0.5, min(5.0, min(limits) / 5.0))

    def beats(self) -> Dict[int, Beat]:
        """Every rank's latest beat (reading the folder)."""
        out = {}
        try:
            names = os.listdir(self.folder)
        except OSError:
            return out
        for name in names:
            if name.startswith("rank") and name[4:].isdigit():
                b = read(os.path.join(self.folder, name))
                if b is not None:
                    out[int(name[4:])] = b
        return out

    def silent(self) -> List[Tuple[int, Beat, float]]:
        """(rank, its last beat, seconds silent) of the ranks silent past the timeout, not reported before."""
        now, out = self.clock(), []
        for rank, b in self.beats().items():
            last = self._seen.get(rank)
            if last is None or last[0] != b:
                self._seen[rank] = (b, now)
                continue
            quiet, limit = now - last[1], b.timeout_s or self.timeout_s
            if limit > 0 and quiet > limit and rank not in self._reported:
                self._reported.add(rank)
                out.append((rank, b, quiet))
        return sorted(out)

    def step_of(self, rank: int) -> Optional[int]:
        b = read(path_of(self.folder, rank)) or self._seen.get(rank, (None,))[0]
        return b.step if b is not None and b.step > 0 else None

    def last_step(self) -> Optional[int]:
        """The furthest step any rank reported (the step the job was in)."""
        steps = [b.step for b in self.beats().values() if b.step > 0]
        return max(steps) if steps else None
