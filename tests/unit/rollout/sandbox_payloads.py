"""Hostile programs against the sandbox, and which mode is promised to hold each one.

EXPECT is the table docs/sandbox.md prints ("What each mode contains"): for each payload and each
(mode, kind of rank), "held" (the sandbox contains it: the tests assert it) or "open" (the mode does
not promise to: the tests assert the escape where it is certain on any node). test_sandbox_escapes.py
runs every payload in every mode on the suite's own rank (root on CI and the dev cluster) and, as
an unprivileged uid, for a user's rank; it also checks that the docs' table is this one.

This file is also the script the unprivileged uid runs (`python3 sandbox_payloads.py SRC`): it
must need nothing but the standard library and the sandbox's own modules.
"""
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

MODES = ("bwrap", "namespaces", "rlimits")
RANKS = ("root", "user")
EXPECT_COLUMNS = [(m, r) for m in MODES for r in RANKS]  # the docs table's columns, in order
LIMITS = dict(cpu_time_s=1, wall_time_s=20, memory_mb=256, max_processes=8, max_output_bytes=4096)
DAEMON_SECONDS = "3601.37"  # the left-behind process's `sleep` argument: its mark in /proc


@dataclass
class Payload:
    name: str  # the table's row
    code: str  # {rank_pid}, {secret!r}, {outside!r} and {port} are replaced with Env's fields
    held: Callable  # (result, env) -> True when the sandbox contained it
    certain: bool = False  # the escape of an "open" cell happens on any node (asserted too)


@dataclass
class Env:
    """What a payload aims at, made by the runner: the rank's pid, a file of the node outside
    the sandbox, a folder anyone may write, a port the rank listens on."""
    rank_pid: int
    secret: str
    outside: str
    port: int


def _printed(word: str) -> Callable:
    return lambda r, env: word not in r.stdout


def _status(*statuses: str) -> Callable:
    return lambda r, env: r.status in statuses


KERNEL = r'''
import os
for path in ["/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches", "/proc/sysrq-trigger",
             "/sys/kernel/uevent_helper", "/sys/kernel/mm/transparent_hugepage/enabled"]:
    try:
        os.close(os.open(path, os.O_WRONLY))  # opened, never written
        print("ESCAPED", path)
    except OSError as e:
        print("held", path, e.strerror)
path = "/proc/sys/fs/lease-break-time"  # written back unchanged: the write itself is the test
try:
    value = open(path).read()
    with open(path, "w") as f:
        f.write(value)
    print("ESCAPED", path)
except OSError as e:
    print("held", path, e.strerror)
print("uid", os.getuid())
'''

FORGE = r'''
import ctypes, glob, os
parent = os.getppid()
for fd in glob.glob(f"/proc/{parent}/fd/*"):
    try:
        with open(fd, "w") as f:
            f.write('{"exit": 0}')
        print("wrote", fd)
    except OSError:
        pass
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, parent, None, None) == 0:  # PTRACE_ATTACH
    print("ESCAPED ptrace")
try:
    os.kill(parent, 9)
except OSError:
    pass
raise SystemExit(3)
'''

CGROUP = r'''
import glob, os
for procs in glob.glob("/sys/fs/cgroup/cgroup.procs") + glob.glob("/sys/fs/cgroup/*/cgroup.procs"):
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
        print("ESCAPED", procs)
    except OSError as e:
        print("held", procs, e.strerror)
'''

# The 7 children hold their memfds at the same time whatever the machine's load: each says so on a
# pipe once its 60 MiB are written and holds them until the parent lets go, and the parent claims
# the escape only when all 7 have said it (a fixed sleep let a loaded machine's children finish one
# after the other, never over the limit together). A child the limit kills closes its end: the
# parent reads the pipe's end, not 7 bytes, and claims nothing.
MEMFDS_MANY = r'''
import os
said_r, said_w = os.pipe()
go_r, go_w = os.pipe()
for _ in range(7):
    if os.fork() == 0:
        os.close(said_r)
        os.close(go_w)
        fds = []
        try:
            for _ in range(60):
                fd = os.memfd_create("x")
                os.write(fd, bytes(1 << 20))
                fds.append(fd)
        except OSError:
            pass
        os.write(said_w, b"1")
        os.read(go_r, 1)  # the parent's end closing: all 7 held theirs at once
        os._exit(0)
os.close(said_w)
os.close(go_r)
said = b""
while len(said) < 7:
    more = os.read(said_r, 7)
    if not more:
        break
    said += more
if len(said) == 7:
    print("ESCAPED: 7 processes hold their memfds")  # ~420 MiB against 256 + the sandbox's own
os.close(go_w)
for _ in range(7):
    os.wait()
'''

CPU_CHILDREN = r'''
import os, time
for _ in range(4):
    if os.fork() == 0:
        start = time.process_time()
        while time.process_time() - start < 0.8:
            pass
        os._exit(0)
for _ in range(4):
    os.wait()
print("ESCAPED: 4 x 0.8 s of CPU against 1 s")
'''

PAYLOADS: List[Payload] = [
    Payload("read a world-readable file of the node", "print(open({secret!r}).read())",
            lambda r, env: "hunter2" not in r.stdout + r.stderr, certain=True),
    Payload("read /etc/shadow", "print(len(open('/etc/shadow').read()), 'ESCAPED')", _printed("ESCAPED")),
    Payload("write into a world-writable folder of the node",
            "open({outside!r} + '/written', 'w').write('x'); print('ESCAPED')",
            lambda r, env: not os.path.exists(os.path.join(env.outside, "written")), certain=True),
    Payload("connect to a port on the node",
            "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('ESCAPED')",
            _printed("ESCAPED"), certain=True),
    Payload("signal the rank", "import os\nos.kill({rank_pid}, 0)\nprint('ESCAPED')", _printed("ESCAPED"),
            certain=True),
    Payload("write kernel settings (/proc/sys, /sys)", KERNEL, _printed("ESCAPED")),
    Payload("leave the run's cgroups", CGROUP, _printed("ESCAPED")),
    Payload("forge its exit status", FORGE,
            lambda r, env: not r.ok and r.exit_code != 0 and "ESCAPED" not in r.stdout),
    Payload("fork bomb", "import os\nwhile True:\n    os.fork()", _status("process_limit")),
    Payload("allocate 8 GiB", "x = bytearray(8 * 2**30)\nprint('ESCAPED')", _status("memory_limit")),
    Payload("hold 384 MiB in memfds from one process",
            "import os\nfds = [os.memfd_create('x') for _ in range(384)]\n"
            "[os.write(f, bytes(1 << 20)) for f in fds]\nprint('ESCAPED')", _printed("ESCAPED")),
    Payload("hold memfds from 7 processes", MEMFDS_MANY, _status("memory_limit"), certain=True),
    Payload("fill /dev/shm with 64 MiB",
            "for i in range(64):\n    open(f'/dev/shm/verl_hpc_payload_{i}', 'wb').write(bytes(1 << 20))\n"
            "print('ESCAPED')", _printed("ESCAPED")),
    Payload("busy loops in 4 children", CPU_CHILDREN, _status("cpu_limit")),
    Payload("print without end", "while True:\n    print('y' * 1000)", _status("output_limit")),
    Payload("leave a process behind (setsid)",
            f"import subprocess\nsubprocess.Popen(['sleep', '{DAEMON_SECONDS}'], start_new_session=True)",
            lambda r, env: not _daemons()),
    Payload("run a program it wrote in scratch",
            "import os, subprocess\nopen('x', 'w').write('#!/bin/sh\\necho ESCAPED\\n')\nos.chmod('x', 0o755)\n"
            "print(subprocess.run(['./x'], capture_output=True, text=True).stdout)", _printed("ESCAPED")),
    Payload("a lone surrogate in its code", "s = '\ud800'\nprint(len(s), ascii(s))",
            lambda r, env: r.ok and r.stdout == "1 '\\ud800'\n"),
]

# (payload, mode, rank) cells the sandbox does not promise to hold; every other cell is "held"
OPEN = {
    ("read a world-readable file of the node", "rlimits"): RANKS,
    ("write into a world-writable folder of the node", "rlimits"): RANKS,
    ("connect to a port on the node", "rlimits"): RANKS,
    ("signal the rank", "rlimits"): ("user",),
    ("hold memfds from 7 processes", "bwrap"): ("user",),  # no memory cgroup for a user's rank
    ("hold memfds from 7 processes", "namespaces"): ("user",),
    ("hold memfds from 7 processes", "rlimits"): ("user",),
    ("fill /dev/shm with 64 MiB", "rlimits"): RANKS,  # the node's own /dev/shm, where it is writable
    ("run a program it wrote in scratch", "bwrap"): ("user",),  # bubblewrap has no noexec binds
    ("run a program it wrote in scratch", "rlimits"): RANKS,
}


def expected(payload: str, mode: str, rank: str) -> str:
    return "open" if rank in OPEN.get((payload, mode), ()) else "held"


def _daemons() -> List[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == f"sleep\0{DAEMON_SECONDS}\0".encode():
                    found.append(pid)
        except OSError:
            pass
    return found


def run_payloads(make_box: Callable[[str], object], rank: str, modes=MODES) -> List[dict]:
    """Every payload in every mode; one record per cell: held or not, as expected or not."""
    records = []
    with tempfile.TemporaryDirectory() as folder, socket.socket() as server:
        os.chmod(folder, 0o755)
        secret, outside = os.path.join(folder, "secret.txt"), os.path.join(folder, "outside")
        with open(secret, "w") as f:
            f.write("hunter2-secret")
        os.chmod(secret, 0o644)
        os.mkdir(outside)
        os.chmod(outside, 0o1777)
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        env = Env(os.getpid(), secret, outside, server.getsockname()[1])
        for mode in modes:
            box = make_box(mode)
            for p in PAYLOADS:
                result = box.run_python(_fill(p.code, env))
                held = bool(p.held(result, env))
                records.append({"payload": p.name, "mode": mode, "rank": rank, "held": held,
                                "expected": expected(p.name, mode, rank), "certain": p.certain,
                                "result": f"{result.status} {result.exit_code} {result.stdout[-300:]!r} "
                                          f"{result.stderr[-300:]!r}"})
                _clean(outside)
                for pid in _daemons():  # an escaped daemon must not fail the next cell too
                    os.kill(int(pid), 9)
            ok = box.run_python("print(6*7)")  # the node and the next run are unaffected
            records.append({"payload": "print(6*7) after them", "mode": mode, "rank": rank,
                            "held": ok.ok and ok.stdout == "42\n", "expected": "held", "certain": False,
                            "result": repr(ok)})
    return records


def _fill(code: str, env: Env) -> str:
    for key, value in vars(env).items():
        code = code.replace(f"{{{key}}}", str(value)).replace(f"{{{key}!r}}", repr(value))
    return code


def _clean(folder: str) -> None:
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    for name in os.listdir("/dev/shm"):
        if name.startswith("verl_hpc_payload_"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def wrong(records: List[dict]) -> List[str]:
    """The cells whose outcome is not the table's: a held cell that escaped, a certain open one held."""
    bad = []
    for r in records:
        if r["expected"] == "held" and not r["held"]:
            bad.append(f"{r['payload']} [{r['mode']}, {r['rank']} rank] ESCAPED: {r['result']}")
        elif r["expected"] == "open" and r["certain"] and r["held"]:
            bad.append(f"{r['payload']} [{r['mode']}, {r['rank']} rank] held, but the docs say open: {r['result']}")
    return bad


def _main(src: str, scratch_root: str) -> None:
    """As an unprivileged uid: load the sandbox from a copy of the source without its package's
    heavy imports (torch, omegaconf: the uid may not read the job's environment), then run."""
    import types

    for name in ("verl_hpc.config", "verl_hpc.rollout", "verl_hpc.rollout.tools"):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(src, *name.split("."))]
        sys.modules[name] = package
    sys.path.insert(0, src)
    from verl_hpc.rollout.tools.sandbox import Sandbox

    records = run_payloads(lambda mode: Sandbox(mode=mode, scratch_root=scratch_root, **LIMITS), "user")
    print(json.dumps(records))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
