"""The sandbox's hold on a run's processes: reading its pipes under an output cap and a deadline
while a watcher checks the run's CPU time, finding and killing its whole process tree, and the
tree's CPU time where no cgroup counts it. Kept apart from sandbox.py, which builds the run, so
that each reads as one concern; the run's cgroups are in sandbox_cgroups.py."""
from __future__ import annotations

import logging
import os
import selectors
import signal
import time
from typing import Callable, Dict, List, Tuple

log = logging.getLogger(__name__)

DRAIN_S = 0.5  # after the program ends: how long a descendant holding its pipes may keep them
WATCH_S = 0.2  # how often the watcher (the run's CPU time) is asked: a /proc scan without a cgroup
_TICK = os.sysconf("SC_CLK_TCK")


def read_capped(proc, deadline: float, max_bytes: int, kill: Callable[[], None],
                watch: Callable[[], str] = lambda: "") -> Tuple[bytes, bytes, str]:
    """Read stdout and stderr as they fill, keeping `max_bytes` in all. Returns the kept bytes and
    why the program was stopped ('output_limit', 'timeout', what `watch` returned, or '').
    `watch` is asked every WATCH_S while the program runs: a non-empty answer stops it."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for stream in bufs:
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    total, ended_at, watched = 0, None, 0.0

    def stop(why: str) -> Tuple[bytes, bytes, str]:
        kill()
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), why

    try:
        while sel.get_map():
            now = time.monotonic()
            if ended_at is None and proc.poll() is not None:
                ended_at = now
            if ended_at is not None and now - ended_at > DRAIN_S:
                break  # a descendant that escaped keeps the pipes open: do not wait for it
            if now >= deadline:
                return stop("timeout")
            if ended_at is None and now - watched >= WATCH_S:
                watched = now
                why = watch()
                if why:
                    return stop(why)
            for key, _ in sel.select(min(deadline - now, 0.1)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                bufs[key.fileobj] += data[:max(max_bytes - total, 0)]
                total += len(data)
                if total > max_bytes:
                    return stop("output_limit")
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), ""
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()


def _stats() -> Dict[int, Tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of the process and of the children it has reaped)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": comm may hold spaces
        # state ppid ... utime stime cutime cstime are fields 3 and 14-17 of stat(5)
        found[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / _TICK)
    return found


def tree(root: int, stats: Dict[int, Tuple[int, float]] = None) -> List[int]:
    """`root` and every process below it now (orphans of the run are re-parented to the run's
    sub-reaper, sandbox_inner.py, so they stay in the tree while it lives)."""
    stats = stats if stats is not None else _stats()
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root] if root in stats else []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def tree_cpu_seconds(root: int) -> float:
    """CPU time of the tree under `root`: each live process's own and what it reaped from its
    children. Where no cgroup counts the run, the watcher uses this (checked every WATCH_S)."""
    stats = _stats()
    return sum(stats[pid][1] for pid in tree(root, stats))


def kill_tree(proc, cgroup) -> None:
    """SIGKILL everything of the run. Its process tree is stopped first, pass after pass until no
    new process appears (a stopped process cannot fork, and a killed parent would hand its
    children to init, out of the tree), then killed; then its session, and every process in its
    cgroup, which also holds one that left both. In bwrap and namespaces mode the pid namespace
    takes every process in it along when its first process dies."""
    stopped: List[int] = []
    for _ in range(50):
        new = [p for p in tree(proc.pid) if p not in stopped]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped += new
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if cgroup:
        cgroup.kill_all()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
