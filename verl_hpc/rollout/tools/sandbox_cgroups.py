"""The cgroups of one sandbox run: its process count, its memory (shared memory included) and its
CPU time, counted over every process the run starts, where a limit per process cannot.

Why cgroups: RLIMIT_NPROC does not bind root, RLIMIT_AS does not count shared memory (memfds,
tmpfs files) and RLIMIT_CPU is per process, so four forked children each get the whole budget.
A cgroup per run holds all three for the run as a whole. Which controllers this process may use
is probed once (a child folder made, its limit file written, removed): root on most nodes may,
a user under Slurm usually may not, and then the sandbox says so in describe() and falls back
(docs/sandbox.md, "The limits").

cgroup v1 (one hierarchy per controller, as here) and v2 (one unified tree, where the rank's own
cgroup enables the controller for its children) are both read from /proc/self/mountinfo and
/proc/self/cgroup, so a container's cgroup namespace and non-standard mount points work too.
"""
from __future__ import annotations

import logging
import os
import pathlib
import signal
import threading
import time
import uuid
from typing import Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

# controller -> (v1 files: limit, usage/event), (v2 files); cpu has no limit file: it is watched
_FILES = {
    "pids": {"v1": ("pids.max", "pids.events"), "v2": ("pids.max", "pids.events")},
    "memory": {"v1": ("memory.limit_in_bytes", "memory.oom_control"), "v2": ("memory.max", "memory.events")},
    "cpu": {"v1": (None, "cpuacct.usage"), "v2": (None, "cpu.stat")},
}
_V1_NAME = {"pids": "pids", "memory": "memory", "cpu": "cpuacct"}  # the v1 hierarchy's controller


def _mounts() -> List[Tuple[str, str, str, List[str]]]:
    """(mount root, mount point, fstype, super options) of every cgroup file system."""
    found = []
    try:
        lines = pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], rest[0], rest[2].split(",")))
    return found


def _own_paths() -> Dict[str, str]:
    """hierarchy key ('v2' or a v1 controller) -> this process's cgroup path in it."""
    paths = {}
    try:
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            paths["v2"] = path
        for c in controllers.split(","):
            paths[c] = path
    return paths


def _candidates(controller: str) -> List[Tuple[str, str]]:
    """(version, folder) where this process's cgroup for `controller` lives: v1 first, then v2."""
    own, found = _own_paths(), []
    for root, point, fstype, options in _mounts():
        key = "v2" if fstype == "cgroup2" else _V1_NAME[controller]
        if fstype == "cgroup" and key not in options:
            continue
        path = own.get(key)
        if path is None or not (path + "/").startswith(root.rstrip("/") + "/"):
            continue  # this process's cgroup is outside the part of the tree this mount shows
        rel = path[len(root.rstrip("/")):].strip("/")
        found.append(("v2" if fstype == "cgroup2" else "v1", os.path.join(point, rel).rstrip("/")))
    return sorted(found, key=lambda c: c[0])  # "v1" < "v2"


def _works(version: str, base: str, controller: str) -> bool:
    limit, usage = _FILES[controller][version]
    probe = os.path.join(base, f"verl_hpc_sandbox_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        if limit:
            unlimited = "-1" if (controller, version) == ("memory", "v1") else "max"
            pathlib.Path(probe, limit).write_text(unlimited)
        return os.path.exists(os.path.join(probe, usage))
    except OSError:
        return False
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


class RunCgroups:
    """The cgroups of one run, one folder per hierarchy in use (v1: one per controller; v2: one)."""

    _lock = threading.Lock()
    _bases: Optional[Dict[str, Tuple[str, str]]] = None  # controller -> (version, base folder)

    @classmethod
    def bases(cls) -> Dict[str, Tuple[str, str]]:
        """Controllers this process may use for its runs (probed once per process)."""
        with cls._lock:
            if cls._bases is None:
                cls._bases = {}
                for controller in _FILES:
                    usable = next((c for c in _candidates(controller) if _works(*c, controller)), None)
                    if usable:
                        cls._bases[controller] = usable
            return cls._bases

    def __init__(self, bases: Dict[str, Tuple[str, str]], *, max_pids: int, memory_bytes: int):
        self.version = {c: v for c, (v, _) in bases.items()}
        name = f"verl_hpc_sandbox_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        self.folder: Dict[str, str] = {}
        try:
            for controller, (version, base) in bases.items():
                folder = os.path.join(base, name)
                if folder not in self.folder.values():
                    os.mkdir(folder)
                self.folder[controller] = folder
            self._write("pids", str(max_pids))
            self._write("memory", str(memory_bytes))
            self._no_swap()
        except OSError:
            self.remove()
            raise

    @property
    def procs(self) -> List[str]:
        """The cgroup.procs file of each folder: the run's first process joins every one."""
        return [os.path.join(f, "cgroup.procs") for f in dict.fromkeys(self.folder.values())]

    def _write(self, controller: str, value: str) -> None:
        if controller in self.folder:
            limit = _FILES[controller][self.version[controller]][0]
            pathlib.Path(self.folder[controller], limit).write_text(value)

    def _no_swap(self) -> None:
        """Shared memory that can be swapped out is not bounded by the RAM limit: bound swap too
        (the file exists only where swap accounting is on)."""
        if "memory" not in self.folder:
            return
        folder, v2 = self.folder["memory"], self.version["memory"] == "v2"
        name, value = ("memory.swap.max", "0") if v2 else ("memory.memsw.limit_in_bytes", None)
        path = pathlib.Path(folder, name)
        if path.exists():
            path.write_text(value or pathlib.Path(folder, "memory.limit_in_bytes").read_text().strip())

    def _counter(self, controller: str, key: str) -> int:
        """A 'key N' line of the controller's event file (pids.events 'max', memory 'oom_kill')."""
        if controller not in self.folder:
            return 0
        events = _FILES[controller][self.version[controller]][1]
        try:
            words = pathlib.Path(self.folder[controller], events).read_text().split()
        except OSError:
            return 0
        return int(words[words.index(key) + 1]) if key in words[:-1] else 0

    def process_limit_hit(self) -> bool:
        """Whether a fork was refused for the process limit."""
        return self._counter("pids", "max") > 0

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for the memory limit."""
        return self._counter("memory", "oom_kill") > 0

    def cpu_seconds(self) -> Optional[float]:
        """CPU time of every process the run has had, ended ones included; None without the cgroup."""
        if "cpu" not in self.folder:
            return None
        usage = _FILES["cpu"][self.version["cpu"]][1]
        try:
            text = pathlib.Path(self.folder["cpu"], usage).read_text()
        except OSError:
            return None
        if self.version["cpu"] == "v1":
            return int(text) / 1e9
        words = text.split()
        return int(words[words.index("usage_usec") + 1]) / 1e6

    def pids(self) -> List[int]:
        for procs in self.procs:
            try:
                return [int(p) for p in pathlib.Path(procs).read_text().split()]
            except OSError:
                continue
        return []

    def kill_all(self) -> None:
        for _ in range(100):  # a fork bomb refills the list while we kill: until it is empty
            pids = self.pids()
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
        for folder in dict.fromkeys(self.folder.values()):
            for _ in range(100):  # the killed processes leave the cgroup once reaped
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                log.warning("sandbox: could not remove %s", folder)
