"""The sandbox's hold on a run's processes: reading its pipes under an output cap and a deadline,
killing its whole tree, and the per-run pids cgroup that limits its processes where RLIMIT_NPROC
cannot (root ignores it). Kept apart from sandbox.py, which builds the run, so that each reads as
one concern."""
from __future__ import annotations

import logging
import os
import pathlib
import selectors
import signal
import threading
import time
import uuid
from typing import List, Optional, Tuple

log = logging.getLogger(__name__)

DRAIN_S = 0.5  # after the program ends: how long a descendant holding its pipes may keep them


def read_capped(proc, deadline: float, max_bytes: int, kill) -> Tuple[bytes, bytes, str]:
    """Read stdout and stderr as they fill, keeping `max_bytes` in all. Returns the kept bytes and
    why the program was stopped ('output_limit', 'timeout' or '')."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for stream in bufs:
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    total, ended_at = 0, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if ended_at is None and proc.poll() is not None:
                ended_at = now
            if ended_at is not None and now - ended_at > DRAIN_S:
                break  # a descendant that escaped keeps the pipes open: do not wait for it
            if now >= deadline:
                kill()
                return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), "timeout"
            for key, _ in sel.select(min(deadline - now, 0.1)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                bufs[key.fileobj] += data[:max(max_bytes - total, 0)]
                total += len(data)
                if total > max_bytes:
                    kill()
                    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), "output_limit"
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), ""
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()


def kill_tree(proc, cgroup) -> None:
    """SIGKILL the run's session; the pid namespace (bwrap, namespaces) takes every process in it
    along when its first process dies, and the cgroup catches a process that left the session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if cgroup:
        cgroup.kill_all()



class PidsCgroup:
    """A pids cgroup of one run, below the rank's own (v1 pids hierarchy, or v2 where pids is
    enabled for its children). RLIMIT_NPROC is no limit for root; this is."""

    _lock = threading.Lock()
    _base: Optional[str] = None
    _probed = False

    @classmethod
    def base(cls) -> Optional[str]:
        """The folder runs' cgroups are made in, or None where this process cannot make one."""
        with cls._lock:
            if not cls._probed:
                cls._probed = True
                cls._base = next((b for b in cls._candidates() if cls._works(b)), None)
            return cls._base

    @staticmethod
    def _candidates() -> List[str]:
        found = []
        try:
            lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return found
        for line in lines:
            hierarchy, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(","):
                found.append(f"/sys/fs/cgroup/pids{path}".rstrip("/"))
            elif hierarchy == "0":
                found.append(f"/sys/fs/cgroup{path}".rstrip("/"))
        return found

    @staticmethod
    def _works(base: str) -> bool:
        probe = os.path.join(base, f"verl_hpc_sandbox_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(probe)
        except OSError:
            return False
        try:
            pathlib.Path(probe, "pids.max").write_text("8")
            return True
        except OSError:
            return False
        finally:
            os.rmdir(probe)

    def __init__(self, base: str, limit: int):
        self.path = os.path.join(base, f"verl_hpc_sandbox_{os.getpid()}_{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        pathlib.Path(self.path, "pids.max").write_text(str(limit))
        self.procs = os.path.join(self.path, "cgroup.procs")

    def hit(self) -> bool:
        """Whether a fork was refused for the limit (pids.events counts them)."""
        try:
            events = pathlib.Path(self.path, "pids.events").read_text().split()
        except OSError:
            return False
        return "max" in events and int(events[events.index("max") + 1]) > 0

    def kill_all(self) -> None:
        for _ in range(100):  # a fork bomb refills the list while we kill: until it is empty
            try:
                pids = [int(p) for p in pathlib.Path(self.procs).read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for _ in range(100):  # the killed processes leave the cgroup once reaped
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        log.warning("sandbox: could not remove %s", self.path)
