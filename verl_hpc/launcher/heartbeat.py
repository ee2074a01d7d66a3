"""The supervisor's side of the heartbeats: which rank has gone silent.

    watch = Watch(folder)        # a launch's heartbeat folder (VERL_HPC_HEARTBEAT_DIR of its ranks)
    watch.silent()               # (rank, its last beat, seconds silent) past its timeout, each once
    job_facts(folder)            # what rank 0 said: {checkpoint_dir}

The ranks write (runtime/heartbeat.py: a thread of each rank, `<beats> <step> <pid> <node>
<timeout_s>` in `<folder>/rank<N>`; the reason for a thread, and what stops it, are there). A
silent rank is one that runs no Python at all: the supervisor (launcher/restart_loop.py,
launcher/local_restarts.py) kills it, names it, and counts it as dead (launcher/restarts.py),
where the other ranks would wait in their next collective for trainer.collective_timeout_s and
fail with a timeout that names nobody. The supervisor compares contents, not times: its clock and
a rank's node's clock need not agree, and a shared file system's modification times are its
server's. Standard library only (Python >= 3.8): the Slurm supervisor imports this on the batch
host with whatever python3 is there (not runtime/, whose package imports torch).
"""
import json
import os
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

ENV = "VERL_HPC_HEARTBEAT_DIR"  # runtime/heartbeat.py's ENV and JOB (a unit test keeps them equal)
JOB = "job.json"


class Beat(NamedTuple):
    beats: int
    step: int
    pid: int
    host: str
    timeout_s: float = 0.0  # the rank's trainer.heartbeat_timeout_s


def path_of(folder: str, rank: int) -> str:
    return os.path.join(folder, "rank%d" % rank)


def job_facts(folder: str) -> dict:
    """What rank 0 told its supervisor ({} before it did)."""
    try:
        with open(os.path.join(folder, JOB)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


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
            if b.step < 0:  # its program ended: silence is expected
                continue
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
