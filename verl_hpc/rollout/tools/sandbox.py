"""Run model-written Python in a contained process (the `python` tool's back end; docs/sandbox.md).

    box = Sandbox.from_config(cfg.sandbox)      # mode "auto": probed once per process
    log.info(box.describe())                    # which mode, what it isolates, the limits
    result = box.run_python("print(6*7)")       # SandboxResult(stdout="42\\n", status="ok", ...)

Every run gets a process of its own, started from the job's base Python (not the venv, which lives in
the user's project folder) with `-I`, stdin closed, a minimal environment (no tokens, no
PYTHONPATH) and a private scratch folder as its working directory, removed afterwards. Limits:
CPU seconds, address space, processes, file size, output bytes (the pipes are read as they fill
and the program is stopped once it prints more) and wall time (the whole process tree is killed).

Modes, strongest first (`auto` takes the first this node can run):
- `bwrap`: bubblewrap with every namespace unshared (user, mount, pid, net, ipc, uts), read-only
  binds of the system folders and the interpreter, a private /tmp, the scratch folder the only
  writable place;
- `namespaces`: util-linux `unshare` (user, mount, pid, net, ipc, uts namespaces) and
  `sandbox_inner.py`, which builds a fresh root of the same binds and pivot_root()s into it;
- `rlimits`: limits only. It does NOT stop network access or reading (or writing) the user's files.

The process limit: RLIMIT_NPROC is not enforced for root, and outside a user namespace it counts
every process of the user. So where a pids cgroup is writable (root on most nodes) each run gets
its own with `pids.max`; otherwise bwrap and namespaces rely on RLIMIT_NPROC, which inside a fresh
user namespace counts only that run's processes. docs/sandbox.md has the table.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.multi_turn import SANDBOX_MODES, SandboxConfig
from verl_hpc.rollout.tools.sandbox_process import PidsCgroup, kill_tree, read_capped

log = logging.getLogger(__name__)

_DEFAULTS = SandboxConfig()  # the constructor's defaults are the config's
_INNER = pathlib.Path(__file__).with_name("sandbox_inner.py").read_text()
# where the code sees its files in the bwrap and namespaces modes
_SCRATCH, _MAIN = "/scratch", "/sandbox/main.py"
# processes of the sandbox's own beside the code's (sh joining the cgroup, bwrap's two / unshare)
_OWN_PROCESSES = 4
# text a failed program leaves on stderr when a limit, not its own bug, stopped it
_PROCESS_SIGNS = ("Resource temporarily unavailable", "can't start new thread")
_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc")
# the last line of a traceback when the sandbox refused an action: EPERM, EACCES, EROFS,
# EADDRNOTAVAIL, ENETUNREACH, ECONNREFUSED (nothing listens in an empty network namespace)
_DENIED_ERRNOS = ("[Errno 1]", "[Errno 13]", "[Errno 30]", "[Errno 99]", "[Errno 101]", "[Errno 111]")


@dataclass
class SandboxResult:
    stdout: str  # decoded utf-8 with errors="replace", cut to the output limit
    stderr: str  # the same; a limit that stopped the program adds a last line saying which
    exit_code: Optional[int]  # None when killed
    status: str  # ok | error | timeout | cpu_limit | memory_limit | output_limit | process_limit | denied
    seconds: float
    mode: str  # bwrap | namespaces | rlimits

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox:
    _probe_lock = threading.Lock()
    _probed: Dict[str, bool] = {}  # mode -> runs on this node; per process, shared by instances

    def __init__(self, *, mode: str = _DEFAULTS.mode, cpu_time_s: float = _DEFAULTS.cpu_time_s,
                 wall_time_s: float = _DEFAULTS.wall_time_s, memory_mb: int = _DEFAULTS.memory_mb,
                 max_processes: int = _DEFAULTS.max_processes,
                 max_output_bytes: int = _DEFAULTS.max_output_bytes,
                 max_file_bytes: int = _DEFAULTS.max_file_bytes, scratch_root: str = _DEFAULTS.scratch_root):
        if mode not in SANDBOX_MODES:
            raise ConfigError(f"sandbox.mode = {mode!r}: expected one of {', '.join(SANDBOX_MODES)}")
        self.cpu_time_s, self.wall_time_s, self.memory_mb = cpu_time_s, wall_time_s, memory_mb
        self.max_processes, self.max_output_bytes = max_processes, max_output_bytes
        self.max_file_bytes = max_file_bytes
        self.scratch_root = _writable_folder(scratch_root or os.environ.get("TMPDIR") or tempfile.gettempdir())
        self.python = _base_python()
        self._cgroup_base = PidsCgroup.base()
        self.mode = self._resolve(mode)

    @classmethod
    def from_config(cls, sandbox_cfg) -> "Sandbox":
        c = sandbox_cfg
        return cls(mode=c.mode, cpu_time_s=c.cpu_time_s, wall_time_s=c.wall_time_s, memory_mb=c.memory_mb,
                   max_processes=c.max_processes, max_output_bytes=c.max_output_bytes,
                   max_file_bytes=c.max_file_bytes, scratch_root=c.scratch_root)

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
            why = self._unavailable(candidate)
            if not why:
                log.info("sandbox: mode auto -> %s%s", candidate, f" ({'; '.join(reasons)})" if reasons else "")
                return candidate
            reasons.append(f"{candidate}: {why}")
        raise AssertionError("rlimits mode always runs")  # pragma: no cover

    def _unavailable(self, mode: str) -> str:
        """Why `mode` cannot run here, '' when it can: the tool is installed and a trial run works."""
        if mode == "rlimits":
            return ""
        tool = "bwrap" if mode == "bwrap" else "unshare"
        if not shutil.which(tool):
            return f"{tool} is not installed on this node"
        with Sandbox._probe_lock:
            if mode not in Sandbox._probed:
                Sandbox._probed[mode] = self._trial(mode)
        return "" if Sandbox._probed[mode] else f"a trial run under {tool} failed (user namespaces not allowed?)"

    def _trial(self, mode: str) -> bool:
        result = self._run("print(6*7)", self.wall_time_s, mode)
        if not result.ok:
            log.info("sandbox: %s trial failed: %s", mode, result.stderr.strip()[-500:])
        return result.ok and result.stdout == "42\n"

    def describe(self) -> str:
        """One line for the job log: the mode, what it isolates, the limits and what enforces them."""
        what = {
            "bwrap": "bubblewrap: own user, mount, pid, net, ipc and uts namespaces; no network; sees only "
                     "read-only system folders and the interpreter, a private /tmp and its scratch folder",
            "namespaces": "unshare: own user, mount, pid, net, ipc and uts namespaces; no network; a fresh root "
                          "of read-only system folders and the interpreter, a private /tmp and its scratch folder",
            "rlimits": "limits only: does NOT stop network access or reading the user's files "
                       "(for nodes that allow no user namespaces)",
        }[self.mode]
        return (f"sandbox: mode {self.mode} ({what}); limits: {self.cpu_time_s:g} s CPU, {self.wall_time_s:g} s "
                f"wall, {self.memory_mb} MiB address space, {self.max_processes} processes "
                f"({self._process_limit_mechanism()}), {self.max_output_bytes} bytes of output, "
                f"{self.max_file_bytes} bytes per file; python {self.python}")

    def _process_limit_mechanism(self) -> str:
        if self._cgroup_base:
            return "pids cgroup"
        if os.geteuid() == 0:
            return "NOT enforced: root without a writable pids cgroup"
        if self.mode == "rlimits":
            return "RLIMIT_NPROC over all the user's processes"
        return "RLIMIT_NPROC in its own user namespace"

    # ------------------------------------------------------------------ a run
    def run_python(self, code: str, *, wall_time_s: Optional[float] = None) -> SandboxResult:
        """Run `code` as a script; thread-safe (each call has its own process and folder)."""
        return self._run(code, wall_time_s or self.wall_time_s, self.mode)

    def _run(self, code: str, wall_time_s: float, mode: str) -> SandboxResult:
        run_dir = tempfile.mkdtemp(prefix="verl_hpc_sandbox_", dir=self.scratch_root)
        cgroup = None
        try:
            scratch = os.path.join(run_dir, "scratch")
            os.mkdir(scratch, 0o700)
            main = os.path.join(run_dir, "main.py")
            pathlib.Path(main).write_text(code, encoding="utf-8", errors="surrogateescape")
            status_r, status_w = os.pipe()
            argv = self._command(mode, run_dir, scratch, main, status_w)
            if self._cgroup_base:
                cgroup = PidsCgroup(self._cgroup_base, self.max_processes + _OWN_PROCESSES)
                argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup.procs, *argv]
            return self._supervise(argv, mode, wall_time_s, cgroup, (status_r, status_w))
        finally:
            if cgroup:
                cgroup.remove()
            shutil.rmtree(run_dir, ignore_errors=True)

    def _limits(self, mode: str) -> List[Tuple[str, int, int]]:
        cpu = max(int(-(-self.cpu_time_s // 1)), 1)  # whole seconds, rounded up
        memory = self.memory_mb << 20
        limits = [("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the limit, SIGKILL a second later
                  ("RLIMIT_AS", memory, memory),
                  ("RLIMIT_FSIZE", self.max_file_bytes, self.max_file_bytes),
                  ("RLIMIT_CORE", 0, 0)]  # SIGXCPU would dump a core into the scratch folder
        nproc = self.max_processes
        if mode == "rlimits" and os.geteuid() != 0:
            nproc += _user_tasks(os.getuid())  # outside a user namespace it counts all of them
        if os.geteuid() != 0 or mode != "rlimits":
            limits.append(("RLIMIT_NPROC", nproc, nproc))
        return limits

    def _command(self, mode: str, run_dir: str, scratch: str, main: str, status_fd: int) -> List[str]:
        """The argv that starts the sandbox: a wrapper (bwrap, unshare or none) around
        `python -I -S -c <sandbox_inner.py> <plan>`, which sets the limits and execs the code."""
        inside = mode != "rlimits"
        cwd, script = (_SCRATCH, _MAIN) if inside else (scratch, main)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "TMPDIR": "/tmp" if inside else cwd,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        plan = {"root": None, "cwd": cwd, "limits": self._limits(mode), "env": env,
                "argv": [self.python, "-I", script], "status_fd": status_fd}
        if mode == "namespaces":
            plan["root"] = {"dir": os.path.join(run_dir, "root"), "binds": self._binds(scratch, main),
                            "symlinks": _system_symlinks(), "tmp_bytes": self._tmp_bytes()}
            os.mkdir(plan["root"]["dir"])
        inner = [self.python, "-I", "-S", "-c", _INNER, json.dumps(plan)]
        if mode == "namespaces":
            return ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts",
                    "--fork", "--kill-child", *inner]
        if mode == "bwrap":
            return ["bwrap", *self._bwrap_args(scratch, main), *inner]
        return inner

    def _binds(self, scratch: str, main: str) -> List[Tuple[str, str, bool]]:
        """(source, place in the sandbox, writable): the interpreter and the system folders it
        needs, read-only; the scratch folder read-write; a few harmless device nodes."""
        ro = [(p, p, False) for p in _read_only_paths(self.python)]
        dev = [(d, d, True) for d in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom") if os.path.exists(d)]
        return ro + dev + [(main, _MAIN, False), (scratch, _SCRATCH, True)]

    def _bwrap_args(self, scratch: str, main: str) -> List[str]:
        args = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--hostname", "sandbox", "--dev", "/dev", "--proc", "/proc",
                "--size", str(self._tmp_bytes()), "--tmpfs", "/tmp"]
        for target, link in _system_symlinks():
            args += ["--symlink", target, link]
        for path in _read_only_paths(self.python):
            args += ["--ro-bind", path, path]
        return args + ["--ro-bind", main, _MAIN, "--bind", scratch, _SCRATCH]

    def _tmp_bytes(self) -> int:
        return 16 * self.max_file_bytes  # /tmp is RAM: a few files of the largest allowed size

    def _supervise(self, argv: List[str], mode: str, wall_time_s: float, cgroup, pipe) -> SandboxResult:
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                    start_new_session=True, close_fds=True, pass_fds=(pipe[1],))
        finally:
            os.close(pipe[1])  # the child holds it now; EOF on the read end once the run is over
        try:
            out, err, stopped = read_capped(proc, start + wall_time_s, self.max_output_bytes,
                                             lambda: kill_tree(proc, cgroup))
        finally:
            kill_tree(proc, cgroup)  # whatever the program left behind
            proc.wait()
            report = _read_report(pipe[0])
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
        if stopped:  # output_limit or timeout, unless a fork bomb was behind it
            return "process_limit" if _process_limit_hit(stderr, cgroup) else stopped
        if rc == 0 and not sig:
            return "ok"
        if _process_limit_hit(stderr, cgroup):
            return "process_limit"
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
def _base_python() -> str:
    """The job's base interpreter: a venv's python would need the venv, inside the user's project."""
    exe = getattr(sys, "_base_executable", "") or sys.executable
    return os.path.realpath(exe)


def _writable_folder(path: str) -> str:
    """The scratch root, checked once here: a run must not fail on it, one run after another."""
    if not (os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)):
        raise ConfigError(f"sandbox.scratch_root = {path!r}: not a writable folder (each run makes its "
                          "scratch folder there; '' = $TMPDIR or /tmp)")
    return path


def _system_symlinks() -> List[Tuple[str, str]]:
    """Merged-/usr systems link /bin, /lib, ... into /usr: the sandbox gets the same links."""
    return [(os.readlink(p), p) for p in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
            if os.path.islink(p)]


def _read_only_paths(python: str) -> List[str]:
    """System folders (not links), the dynamic linker's cache, and the interpreter's prefix."""
    paths = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
             if os.path.isdir(p) and not os.path.islink(p)]
    paths += [p for p in ("/etc/ld.so.cache", "/etc/localtime") if os.path.exists(p)]
    prefix = os.path.realpath(sys.base_prefix)
    for extra in (prefix, os.path.dirname(python)):
        if not any(extra == p or extra.startswith(p + "/") for p in paths):
            paths.append(extra)
    return paths


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
    return (cgroup is not None and cgroup.hit()) or any(s in stderr for s in _PROCESS_SIGNS)
