"""Run model-written Python in a contained process (the `python` tool's back end; docs/sandbox.md).

    box = Sandbox.from_config(cfg.sandbox)      # mode "auto": probed once per process
    log.info(box.describe())                    # which mode, what it isolates, the limits
    result = box.run_python("print(6*7)")       # SandboxResult(stdout="42\\n", status="ok", ...)

Every run gets a process of its own, started from the job's base Python (not the venv, which lives in
the user's project folder) with `-I`, stdin closed, a minimal environment (no tokens, no
PYTHONPATH) and a private scratch folder as its working directory, removed afterwards. Model code
never runs as root: on a root rank each run gets an unprivileged uid of its own (`uid_base` + a
number unique to the rank process and the run). Limits: CPU seconds and memory of the whole run,
address space, processes, open files, file size, output bytes (the pipes are read as they fill and
the program is stopped once it prints more) and wall time (the whole process tree is killed).

Modes, strongest first (`auto` takes the first this node can run):
- `bwrap`: bubblewrap with every namespace unshared (mount, pid, net, ipc, uts; a user namespace
  too on a user's rank), read-only binds of the system folders and the interpreter, a private
  /tmp, the scratch folder the only writable place;
- `namespaces`: util-linux `unshare` (the same namespaces) and `sandbox_inner.py`, which builds a
  fresh root of the same binds and pivot_root()s into it;
- `rlimits`: limits only. It does NOT stop network access or reading the files the code's uid may
  read. On a root rank `auto` takes it only with `allow_limits_only`.

The run's cgroups (sandbox_cgroups.py) hold its processes, memory and CPU time where this process
may make them (root on most nodes); elsewhere RLIMIT_NPROC, RLIMIT_AS with a low open-files limit,
and the sum over the process tree stand in, as describe() says. docs/sandbox.md has the table.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.multi_turn import MAX_TOOL_WORKERS, SANDBOX_MODES, UID_SPAN, SandboxConfig
from verl_hpc.rollout.tools.sandbox_cgroups import RunCgroups
from verl_hpc.rollout.tools.sandbox_command import RunSpec, base_python, sandbox_command
from verl_hpc.rollout.tools.sandbox_listener import CommandJob, Listener
from verl_hpc.rollout.tools.sandbox_process import kill_tree, read_capped, tree_cpu_seconds

log = logging.getLogger(__name__)

_DEFAULTS = SandboxConfig()  # the constructor's defaults are the config's
# processes of the sandbox's own beside the code's (sh joining the cgroups, bwrap's two / unshare)
_OWN_PROCESSES = 4
_OWN_MEMORY = 64 << 20  # the same processes' memory (a Python waiting, bwrap), on top of memory_mb
# text a failed program leaves on stderr when a limit, not its own bug, stopped it
_PROCESS_SIGNS = ("Resource temporarily unavailable", "can't start new thread")
_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc",
                 "failed to map segment from shared object")  # the dynamic loader, under RLIMIT_AS
# the last line of a traceback when the sandbox refused an action: EPERM, EACCES, EROFS,
# EADDRNOTAVAIL, ENETUNREACH, ECONNREFUSED (nothing listens in an empty network namespace)
_DENIED_ERRNOS = ("[Errno 1]", "[Errno 13]", "[Errno 30]", "[Errno 99]", "[Errno 101]", "[Errno 111]")
# a status that means the user's limit, not the mode, stopped the trial run: the field to raise
_LIMIT_FIELDS = {"timeout": "wall_time_s", "cpu_limit": "cpu_time_s", "memory_limit": "memory_mb",
                 "output_limit": "max_output_bytes", "process_limit": "max_processes"}
_TRIAL = "print(6*7)"
_TOOLS = {"bwrap": "bwrap", "namespaces": "unshare"}  # the program each mode needs on the node


@dataclass
class SandboxResult:
    stdout: str  # decoded utf-8 with errors="replace", cut to the output limit
    stderr: str  # the same; a limit that stopped the program adds a last line saying which
    exit_code: Optional[int]  # None when killed
    status: str  # ok | error | timeout | cpu_limit | memory_limit | output_limit | process_limit | denied | cancelled
    seconds: float
    mode: str  # bwrap | namespaces | rlimits

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox:
    _probe_lock = threading.Lock()
    _probed: Dict[tuple, str] = {}  # (mode, python, limits) -> why it cannot run ('' = it can); per process
    _runs = itertools.count()  # numbers each run of this process: its uid on a root rank

    def __init__(self, *, mode: str = _DEFAULTS.mode, cpu_time_s: float = _DEFAULTS.cpu_time_s,
                 wall_time_s: float = _DEFAULTS.wall_time_s, memory_mb: int = _DEFAULTS.memory_mb,
                 max_processes: int = _DEFAULTS.max_processes,
                 max_output_bytes: int = _DEFAULTS.max_output_bytes,
                 max_file_bytes: int = _DEFAULTS.max_file_bytes, max_open_files: int = _DEFAULTS.max_open_files,
                 scratch_root: str = _DEFAULTS.scratch_root, python: str = _DEFAULTS.python,
                 uid_base: int = _DEFAULTS.uid_base, allow_limits_only: bool = _DEFAULTS.allow_limits_only):
        if mode not in SANDBOX_MODES:
            raise ConfigError(f"sandbox.mode = {mode!r}: expected one of {', '.join(SANDBOX_MODES)}")
        self.cpu_time_s, self.wall_time_s, self.memory_mb = cpu_time_s, wall_time_s, memory_mb
        self.max_processes, self.max_output_bytes = max_processes, max_output_bytes
        self.max_file_bytes, self.max_open_files = max_file_bytes, max_open_files
        self.uid_base, self.allow_limits_only = uid_base, allow_limits_only
        self.as_root = _host_root()
        self.scratch_root = _writable_folder(scratch_root or os.environ.get("TMPDIR") or tempfile.gettempdir())
        self.python = _interpreter(python)
        self._cgroups = RunCgroups.bases()
        self._cancelled = threading.Event()  # before the trial runs, which are watched too
        self.mode = self._resolve(mode)

    def cancel_all(self) -> None:
        """Kill every run in progress within a watch period (0.2 s) and every later one at its start
        (status `cancelled`): a job that stops does not leave its runs to their wall time."""
        self._cancelled.set()

    @classmethod
    def from_config(cls, sandbox_cfg) -> "Sandbox":
        c = sandbox_cfg
        return cls(mode=c.mode, cpu_time_s=c.cpu_time_s, wall_time_s=c.wall_time_s, memory_mb=c.memory_mb,
                   max_processes=c.max_processes, max_output_bytes=c.max_output_bytes,
                   max_file_bytes=c.max_file_bytes, max_open_files=c.max_open_files, scratch_root=c.scratch_root,
                   python=c.python, uid_base=c.uid_base, allow_limits_only=c.allow_limits_only)

    # ------------------------------------------------------------------ mode
    def _resolve(self, mode: str) -> str:
        if mode != "auto":
            why = self._unavailable(mode)
            if why:
                raise ConfigError(f"sandbox.mode = {mode}: {why}; use sandbox.mode=auto to take the "
                                  "strongest mode this node allows")
            return mode
        reasons = []
        for candidate in (m for m in SANDBOX_MODES if m != "auto"):  # the config lists them strongest first
            if candidate == "rlimits" and self.as_root and not self.allow_limits_only:
                raise ConfigError(
                    f"sandbox.mode = auto: no mode that contains model code runs on this node ({'; '.join(reasons)}), "
                    "and the rank runs as root: install bubblewrap, or set sandbox.allow_limits_only=true to "
                    "run it in rlimits mode (limits only; docs/sandbox.md)")
            why = self._unavailable(candidate)
            if not why:
                if reasons:  # one line, at warning level: the job runs with less than it could
                    log.warning("sandbox: mode auto -> %s, not the stronger %s", candidate, "; ".join(reasons))
                else:
                    log.info("sandbox: mode auto -> %s", candidate)
                return candidate
            reasons.append(f"{candidate}: {why}")
        raise ConfigError(f"sandbox.mode = auto: no mode runs on this node ({'; '.join(reasons)})")

    def _unavailable(self, mode: str) -> str:
        """Why `mode` cannot run here, '' when it can: the tool is installed and a trial run works.
        A trial stopped by one of the user's own limits raises: that is the limit, not the mode."""
        tool = _TOOLS.get(mode)
        if tool and not shutil.which(tool):
            return f"{tool} is not installed on this node"
        key = (mode, self.python, self.as_root, self.scratch_root, *self._trial_limits())
        with Sandbox._probe_lock:
            if key not in Sandbox._probed:
                Sandbox._probed[key] = self._trial(mode)
        return Sandbox._probed[key]

    def _trial_limits(self) -> tuple:
        return (self.wall_time_s, self.cpu_time_s, self.memory_mb, self.max_output_bytes, self.max_processes,
                self.max_open_files)

    def _trial(self, mode: str) -> str:
        result = self._run(_TRIAL, self.wall_time_s, mode)
        if result.ok and result.stdout == "42\n":
            return ""
        if result.status in _LIMIT_FIELDS or "Too many open files" in result.stderr:
            field = _LIMIT_FIELDS.get(result.status, "max_open_files")
            raise ConfigError(f"sandbox.{field} = {getattr(self, field)}: the sandbox's trial run ({_TRIAL}, "
                              f"mode {mode}) was stopped by this limit ({result.status}); raise it")
        log.info("sandbox: %s trial failed: %s", mode, result.stderr.strip()[-500:])
        last = result.stderr.strip().rsplit("\n", 1)[-1][:200]
        tool = _TOOLS.get(mode, self.python)
        hint = ""
        if mode == "rlimits" and self.as_root and "Permission denied" in last:
            hint = ("; on a root rank rlimits mode runs the code as an unprivileged uid, which must reach "
                    "sandbox.python and sandbox.scratch_root (a Python under /root cannot be: name another, "
                    "e.g. sandbox.python=/usr/bin/python3)")
        return f"a trial run under {tool} failed ({last or result.status}){hint}"

    def describe(self) -> str:
        """One line for the job log: the mode, what it isolates, the limits and what enforces them."""
        what = {
            "bwrap": "bubblewrap: own mount, pid, net, ipc and uts namespaces; no network; sees only "
                     "read-only system folders and the interpreter, a private /tmp and its scratch folder",
            "namespaces": "unshare: own mount, pid, net, ipc and uts namespaces; no network; a fresh root "
                          "of read-only system folders and the interpreter, a private /tmp and its scratch folder",
            "rlimits": "limits only: does NOT stop network access or reading the user's files "
                       "(for nodes that allow no namespaces)",
        }[self.mode]
        who = (f"as its own unprivileged uid (from {self.uid_base}; the rank is root)" if self.as_root
               else "as the job's user" + ("" if self.mode == "rlimits" else " (root of its own user namespace)"))
        cg = self._cgroups
        return (f"sandbox: mode {self.mode} ({what}); code runs {who}; limits: {self.cpu_time_s:g} s CPU per run "
                f"({'cpu accounting cgroup' if 'cpu' in cg else 'summed over the process tree'}), "
                f"{self.wall_time_s:g} s wall, {self.memory_mb} MiB "
                f"({'memory cgroup per run, shared memory included, and ' if 'memory' in cg else ''}"
                f"address space per process, {self.max_open_files} open files), {self.max_processes} processes "
                f"({self._process_limit_mechanism()}), {self.max_output_bytes} bytes of output, "
                f"{self.max_file_bytes} bytes per file; python {self.python}")

    def _process_limit_mechanism(self) -> str:
        if "pids" in self._cgroups:
            return "pids cgroup"
        if self.as_root:
            return "RLIMIT_NPROC of the run's own uid"
        if self.mode == "rlimits":
            return "RLIMIT_NPROC over all the user's processes"
        return "RLIMIT_NPROC in its own user namespace"

    # ------------------------------------------------------------------ a run
    def run_python(self, code: str, *, wall_time_s: Optional[float] = None) -> SandboxResult:
        """Run `code` as a script; thread-safe (each call has its own process and folder)."""
        return self._run(code, wall_time_s or self.wall_time_s, self.mode)

    def run_command(self, command: str, *, wall_time_s: Optional[float] = None, env: Optional[Dict[str, str]] = None,
                    files: Optional[Dict[str, str]] = None, read_only: Tuple[str, ...] = (),
                    serve: Optional[Callable[[socket.socket], Callable[[], None]]] = None,
                    url_env: str = "", url: str = "") -> SandboxResult:
        """Run a command line (`/bin/sh -c command`) under the same limits, in the scratch folder,
        which holds `files` (name -> text) first. `env` is added to the minimal environment;
        `read_only` names node folders the run also sees, read-only. With `serve`, the run gets a
        TCP socket listening on 127.0.0.1 of its own network namespace (made inside the sandbox,
        handed out by fd): `serve(sock)` starts serving it and returns what stops that, called
        when the run ends; `url` with "{port}" filled in is the code's `url_env` variable. Its
        own loopback port is then all the code can reach of any network (bwrap, namespaces)."""
        job = CommandJob(command, dict(env or {}), dict(files or {}), tuple(read_only), serve, url_env, url)
        return self._run("", wall_time_s or self.wall_time_s, self.mode, job)

    def _run(self, code: str, wall_time_s: float, mode: str, job: Optional[CommandJob] = None) -> SandboxResult:
        run_dir = tempfile.mkdtemp(prefix="verl_hpc_sandbox_", dir=self.scratch_root)
        uid = self._run_uid()
        cgroup = None
        channel = socket.socketpair() if job and job.serve else None
        try:
            os.chmod(run_dir, 0o711)  # the code's uid reaches its scratch folder and main.py, lists nothing
            scratch = os.path.join(run_dir, "scratch")
            os.mkdir(scratch, 0o700)
            main = os.path.join(run_dir, "main.py")
            # a model's text may hold lone surrogates (JSON's "\ud800"), which UTF-8 cannot hold:
            # written as backslash escapes, which mean the same character inside a string literal
            pathlib.Path(main).write_text(code, encoding="utf-8", errors="backslashreplace")
            os.chmod(main, 0o644)
            for name, text in (job.files.items() if job else ()):
                path = os.path.join(scratch, os.path.basename(name))
                pathlib.Path(path).write_text(text, encoding="utf-8", errors="backslashreplace")
                os.chmod(path, 0o644)
            if uid is not None:
                os.chown(scratch, uid, uid)
            status_r, status_w = os.pipe()
            spec = RunSpec(mode, self.python, run_dir, self._limits(mode, uid), uid, status_w,
                           tmp_bytes=16 * self.max_file_bytes, shm_bytes=4 * self.max_file_bytes)
            if job:
                spec.command, spec.env, spec.read_only = job.command, job.env, job.read_only
                if channel:
                    spec.listen = {"fd": channel[1].fileno(), "env": job.url_env, "url": job.url,
                                   "own_net": mode != "rlimits"}
            argv = sandbox_command(spec)
            if self._cgroups:
                cgroup = RunCgroups(self._cgroups, max_pids=self.max_processes + _OWN_PROCESSES,
                                    memory_bytes=(self.memory_mb << 20) + _OWN_MEMORY)
                # the first process joins every cgroup of the run before it execs the wrapper
                join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
                argv = ["/bin/sh", "-c", join, "sandbox", *cgroup.procs, "--", *argv]
            return self._supervise(argv, mode, wall_time_s, cgroup, (status_r, status_w), channel,
                                   job.serve if job else None)
        finally:
            if cgroup:
                cgroup.remove()
            for end in channel or ():
                end.close()
            shutil.rmtree(run_dir, ignore_errors=True)

    def _run_uid(self) -> Optional[int]:
        """On a root rank: a uid (and gid) no other run on the node has now: the rank's pid and
        this run's number modulo the most tool workers a rank runs at once, within
        [uid_base, uid_base + UID_SPAN)."""
        if not self.as_root:
            return None
        slot = next(Sandbox._runs) % MAX_TOOL_WORKERS
        return self.uid_base + (os.getpid() * MAX_TOOL_WORKERS + slot) % UID_SPAN

    def _limits(self, mode: str, uid: Optional[int]) -> List[Tuple[str, int, int]]:
        cpu = max(int(-(-self.cpu_time_s // 1)), 1)  # whole seconds, rounded up
        memory = self.memory_mb << 20
        limits = [("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the limit, SIGKILL a second later
                  ("RLIMIT_AS", memory, memory),
                  ("RLIMIT_FSIZE", self.max_file_bytes, self.max_file_bytes),
                  # each open memfd or tmpfs file holds up to max_file_bytes of RAM outside RLIMIT_AS
                  ("RLIMIT_NOFILE", self.max_open_files, self.max_open_files),
                  ("RLIMIT_CORE", 0, 0)]  # SIGXCPU would dump a core into the scratch folder
        # RLIMIT_NPROC counts the processes of the code's uid in its user namespace: only this run's
        # for a run's own uid or own namespace; all the user's for rlimits mode on a user's rank
        nproc = self.max_processes + (_user_tasks(os.getuid()) if mode == "rlimits" and uid is None else 0)
        return limits + [("RLIMIT_NPROC", nproc, nproc)]

    def _supervise(self, argv: List[str], mode: str, wall_time_s: float, cgroup, pipe, channel=None,
                   serve=None) -> SandboxResult:
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                    start_new_session=True, close_fds=True,
                                    pass_fds=(pipe[1],) + ((channel[1].fileno(),) if channel else ()))
        finally:
            os.close(pipe[1])  # the child holds it now; EOF on the read end once the run is over
            if channel:
                channel[1].close()
        server = Listener(channel[0], serve) if channel else None

        def cpu_watch() -> str:  # the run's CPU time as a whole (RLIMIT_CPU holds each process)
            if self._cancelled.is_set():
                return "cancelled"
            used = cgroup.cpu_seconds() if cgroup else None
            used = tree_cpu_seconds(proc.pid) if used is None else used
            return "cpu_limit" if used >= self.cpu_time_s else ""

        try:
            out, err, stopped = read_capped(proc, start + wall_time_s, self.max_output_bytes,
                                             lambda: kill_tree(proc, cgroup), watch=cpu_watch)
        finally:
            kill_tree(proc, cgroup)  # whatever the program left behind
            proc.wait()
            report = _read_report(pipe[0])
            if server:
                server.stop()
        seconds = time.monotonic() - start
        rc, sig = report.get("exit", 1), report.get("signal", 0)
        if not report:  # the sandbox failed before the code ran (its own error is on stderr), or was killed
            rc, sig = (proc.returncode, 0) if proc.returncode >= 0 else (1, -proc.returncode)
        stderr = err.decode("utf-8", "replace")
        status = self._status(rc, sig, report.get("cpu_s", 0.0), stopped, stderr, cgroup)
        note = self._note(status, wall_time_s)
        return SandboxResult(stdout=out.decode("utf-8", "replace"), stderr=stderr + note,
                             exit_code=None if sig else rc, status=status, seconds=seconds, mode=mode)

    def _status(self, rc: int, sig: int, cpu_s: float, stopped: str, stderr: str, cgroup) -> str:
        if stopped:  # output_limit, timeout or cpu_limit, unless a fork bomb was behind it
            return "process_limit" if _process_limit_hit(stderr, cgroup) else stopped
        if rc == 0 and not sig:
            return "ok"
        if _process_limit_hit(stderr, cgroup):
            return "process_limit"
        if cgroup and cgroup.oom_killed():  # the kernel's kill at the run's memory limit (SIGKILL)
            return "memory_limit"
        # RLIMIT_CPU sends SIGXCPU, then SIGKILL a second later to a program that ignores it
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= int(self.cpu_time_s)):
            return "cpu_limit"
        if any(s in stderr for s in _MEMORY_SIGNS):
            return "memory_limit"
        last = stderr.strip().rsplit("\n", 1)[-1]
        if any(e in last for e in _DENIED_ERRNOS) or last.startswith("PermissionError"):
            return "denied"
        return "error"

    def _note(self, status: str, wall_time_s: float) -> str:
        """The line a stopped program's stderr ends with, so the model reads why it stopped."""
        notes = {"timeout": f"wall time limit ({wall_time_s:g} s)",
                 "cpu_limit": f"CPU time limit ({self.cpu_time_s:g} s)",
                 "memory_limit": f"memory limit ({self.memory_mb} MiB)",
                 "output_limit": f"output limit ({self.max_output_bytes} bytes)",
                 "process_limit": f"process limit ({self.max_processes})"}
        return f"\n[sandbox: stopped by the {notes[status]}]\n" if status in notes else ""


# ---------------------------------------------------------------------- helpers
def _host_root(uid_map: Optional[str] = None) -> bool:
    """Whether this process is the node's uid 0. Root of a user namespace (a rootless container)
    is some other uid of the node, which /proc/sys already refuses, and it could not take the
    runs' uids (they are not mapped there): it is sandboxed as a user's rank is."""
    if os.geteuid() != 0:
        return False
    try:
        uid_map = uid_map if uid_map is not None else pathlib.Path("/proc/self/uid_map").read_text()
    except OSError:
        return True
    for line in uid_map.splitlines():
        inside, outside, count = (int(x) for x in line.split())
        if inside <= 0 < inside + count:
            return outside == inside
    return False


def _interpreter(python: str) -> str:
    """sandbox.python, or the job's base interpreter; checked once here, not at every run."""
    if not python:
        return base_python()
    path = os.path.realpath(python)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ConfigError(f"sandbox.python = {python!r}: not an executable file ('' = the job's base Python)")
    return path


def _writable_folder(path: str) -> str:
    """The scratch root, checked once here: a run must not fail on it, one run after another."""
    if not (os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)):
        raise ConfigError(f"sandbox.scratch_root = {path!r}: not a writable folder (each run makes its "
                          "scratch folder there; '' = $TMPDIR or /tmp)")
    return path


def _user_tasks(uid: int) -> int:
    """Threads of every process of `uid` now: what RLIMIT_NPROC counts outside a user namespace."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = pathlib.Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def _read_report(fd: int) -> dict:
    """sandbox_inner.py's status line: {"exit": n} or {"signal": n}, and "cpu_s"; {} if none."""
    try:
        with os.fdopen(fd, "rb") as f:
            return json.loads(f.read() or b"{}")
    except ValueError:
        return {}


def _process_limit_hit(stderr: str, cgroup) -> bool:
    return (cgroup is not None and cgroup.process_limit_hit()) or any(s in stderr for s in _PROCESS_SIGNS)
