"""The command line that starts one sandbox run, per mode and per kind of rank (root or a user).

    argv = sandbox_command(RunSpec(...))   # [bwrap ... | unshare ... |] python -I -S -c <inner> <plan>

Where the rank runs as root, bwrap and unshare run without a user namespace (in one, uid 0 would
stay the host's uid 0, which the kernel lets write /proc/sys whatever its capabilities): they build
the namespaces and the file view as root, and sandbox_inner.py then drops the code to the run's
own unprivileged uid. Where the rank is a user, both make a user namespace as before and the code
keeps the user's uid. docs/sandbox.md has the table of what each combination contains.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from verl_hpc.config.sections.agent import SANDBOX_PATH  # what agent.command's check resolves names on

INNER = pathlib.Path(__file__).with_name("sandbox_inner.py").read_text()
# where the code sees its files in the bwrap and namespaces modes
SCRATCH, MAIN = "/scratch", "/sandbox/main.py"
# the writable places of a bwrap sandbox that sandbox_inner.py makes noexec on a root rank
_BWRAP_WRITABLE = (SCRATCH, "/tmp", "/dev/shm")
# a bwrap run on a root rank keeps these for sandbox_inner.py (its child, the code, drops them all):
# set-up (mounts, the uid, the bounding set) and the end (killing what the code's uid left running)
_BWRAP_ROOT_CAPS = ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_KILL")


@dataclass
class RunSpec:
    mode: str  # bwrap | namespaces | rlimits
    python: str  # the interpreter the code runs under
    run_dir: str  # the run's folder on the node: main.py, scratch/ (and root/ in namespaces mode)
    limits: List[Tuple[str, int, int]]  # (RLIMIT_ name, soft, hard) for the code's process
    uid: Optional[int]  # the code's unprivileged uid and gid on a root rank; None on a user's rank
    status_fd: int  # the pipe the inner wrapper writes its report to
    tmp_bytes: int  # size of the private /tmp
    shm_bytes: int  # size of /dev/shm (bwrap)
    # a command line instead of `python -I main.py` (command-line agents): run by /bin/sh -c
    command: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)  # added to the minimal environment
    read_only: Tuple[str, ...] = ()  # node folders the code also sees, read-only, at their own paths
    # {"fd": the channel to the rank, "env": variable, "url": its value with "{port}"}: sandbox_inner.listen
    listen: Optional[dict] = None

    @property
    def scratch(self) -> str:
        return os.path.join(self.run_dir, "scratch")

    @property
    def main(self) -> str:
        return os.path.join(self.run_dir, "main.py")


def sandbox_command(run: RunSpec) -> List[str]:
    """The argv that starts the sandbox: a wrapper (bwrap, unshare or none) around
    `python -I -S -c <sandbox_inner.py> <plan>`, which sets the limits and execs the code."""
    inside = run.mode != "rlimits"
    cwd, script = (SCRATCH, MAIN) if inside else (run.scratch, run.main)
    env = {"PATH": SANDBOX_PATH, "HOME": cwd, "TMPDIR": "/tmp" if inside else cwd,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **run.env}
    argv = [run.python, "-I", script] if run.command is None else ["/bin/sh", "-c", run.command]
    as_root = run.uid is not None
    plan = {"root": None, "harden": list(_BWRAP_WRITABLE) if run.mode == "bwrap" and as_root else [],
            "cwd": cwd, "limits": run.limits, "env": env, "uid": run.uid,
            "argv": argv, "status_fd": run.status_fd, "listen": run.listen}
    if run.mode == "namespaces":
        plan["root"] = {"dir": os.path.join(run.run_dir, "root"), "binds": _binds(run),
                        "symlinks": system_symlinks(), "tmp_bytes": run.tmp_bytes}
        os.mkdir(plan["root"]["dir"])
    inner = [run.python, "-I", "-S", "-c", INNER, json.dumps(plan)]
    if run.mode == "namespaces":
        user = [] if as_root else ["--user", "--map-root-user"]
        return ["unshare", *user, "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child",
                "--propagation", "private", *inner]
    if run.mode == "bwrap":
        return ["bwrap", *_bwrap_args(run), *inner]
    return inner


def _binds(run: RunSpec) -> List[Tuple[str, str, str]]:
    """(source, place in the sandbox, kind: ro | rw | dev): the interpreter and the system folders
    it needs, read-only; the scratch folder writable (noexec); a few harmless device nodes."""
    ro = [(p, p, "ro") for p in read_only_paths(run.python) + list(run.read_only)]
    dev = [(d, d, "dev") for d in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom") if os.path.exists(d)]
    return ro + dev + [(run.main, MAIN, "ro"), (run.scratch, SCRATCH, "rw")]


def _bwrap_args(run: RunSpec) -> List[str]:
    if run.uid is None:  # a user's rank: bubblewrap makes the user namespace, nothing to keep
        args = ["--unshare-all", "--unshare-user", "--cap-drop", "ALL"]
    else:  # a root rank: no user namespace (uid 0 in one is the host's); the inner wrapper drops
        args = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                "--cap-drop", "ALL"]
        for cap in _BWRAP_ROOT_CAPS:
            args += ["--cap-add", cap]
    args += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--dev", "/dev",
             # /dev/shm of bubblewrap's /dev is a tmpfs of half the node's RAM: sized like /tmp
             "--perms", "1777", "--size", str(run.shm_bytes), "--tmpfs", "/dev/shm",
             "--proc", "/proc", "--perms", "1777", "--size", str(run.tmp_bytes), "--tmpfs", "/tmp"]
    for target, link in system_symlinks():
        args += ["--symlink", target, link]
    binds = [(path, path) for path in read_only_paths(run.python) + list(run.read_only)] + [(run.main, MAIN)]
    # the folders bubblewrap makes on the way to a bind are 0700 when it runs as root: the code's
    # uid could not reach the interpreter under /root/.pyenv, say; made 0755 first
    for folder in dict.fromkeys(a for _, dst in binds for a in _ancestors(dst)):
        args += ["--perms", "0755", "--dir", folder]
    for src, dst in binds:
        args += ["--ro-bind", src, dst]
    return args + ["--bind", run.scratch, SCRATCH]


def _ancestors(path: str) -> List[str]:
    """'/a/b/c' -> ['/a', '/a/b']."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def base_python() -> str:
    """The job's base interpreter: a venv's python would need the venv, inside the user's project."""
    exe = getattr(sys, "_base_executable", "") or sys.executable
    return os.path.realpath(exe)


def system_symlinks() -> List[Tuple[str, str]]:
    """Merged-/usr systems link /bin, /lib, ... into /usr: the sandbox gets the same links."""
    return [(os.readlink(p), p) for p in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
            if os.path.islink(p)]


def read_only_paths(python: str) -> List[str]:
    """System folders (not links), the dynamic linker's cache, and the interpreter's prefix."""
    paths = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
             if os.path.isdir(p) and not os.path.islink(p)]
    paths += [p for p in ("/etc/ld.so.cache", "/etc/localtime") if os.path.exists(p)]
    prefix = os.path.dirname(os.path.dirname(python))  # <prefix>/bin/python3.x
    own = os.path.realpath(sys.base_prefix) if python == base_python() else prefix
    for extra in (own, os.path.dirname(python)):
        if not any(extra == p or extra.startswith(p + "/") for p in paths):
            paths.append(extra)
    return paths
