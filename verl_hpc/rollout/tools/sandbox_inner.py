"""The part of the sandbox that runs inside it, just before the model's code (stdlib only).

`Sandbox` passes this file's text to the job's base Python as `python -I -S -c <text> <plan>`,
where <plan> is JSON. It runs as the first process of the sandbox (inside `unshare` or `bwrap`, or
directly in rlimits mode) and, in this order (steps 3-4 in the child of step 2):
  1. namespaces mode: builds a fresh root in a tmpfs from read-only binds of the system folders
     and the interpreter, the scratch folder read-write, a private /tmp, a few /dev nodes, a /proc
     whose sys, sysrq-trigger, irq and bus are read-only, then pivot_root()s into it and detaches
     the old root, so nothing else of the node is mounted; scratch and /tmp are nosuid, nodev,
     noexec. bwrap mode on a root rank: the same read-only /proc parts and noexec mounts on what
     bubblewrap built (bubblewrap has no option for either);
  1b. where the plan has `listen` (command-line agents, verl_hpc/rollout/agents/command.py): makes
     a TCP socket listening on 127.0.0.1 inside the run's own network namespace (bringing its
     loopback up where nothing did) and hands it to the rank over the plan's fd; the rank serves
     the agent endpoint on it. The code reaches that one port and nothing else of any network;
  2. becomes the run's sub-reaper and forks; it turns itself non-dumpable first, so that the
     code, whatever its uid, can neither ptrace it nor open its status pipe through /proc;
  3. the child sets the resource limits (lowering only: a limit the node already set lower stays);
  4. the child drops every capability (bounding, ambient, inheritable, permitted), becomes the
     plan's unprivileged uid and gid when the rank is root (model code never runs as root: the
     kernel lets uid 0 write /proc/sys whatever its capabilities), and sets no_new_privs, so the
     code cannot remount, mount, or gain privileges by exec'ing a set-uid program; then it
     exec()s `python -I main.py` in the scratch folder;
  5. the parent waits, kills whatever the code left behind (re-parented to it), and writes how
     the code ended (exit code or signal, CPU seconds) as JSON to the status pipe.
It is not imported by the job: it never runs in a rank's process.
"""
import ctypes
import ctypes.util
import json
import os
import platform
import resource
import socket
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
# statvfs flags that the kernel "locks" on a mount seen from a user namespace: a read-only
# remount of a bind must repeat them or it fails with EPERM (same bit values as the MS_ flags)
LOCKED_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # noatime, nodiratime, relatime
# glibc has no pivot_root() wrapper; the system call's number per architecture
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217, "riscv64": 41}
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 24, 36, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# parts of a fresh /proc that write to the kernel (sysctls, magic SysRq, IRQ affinity, buses)
PROC_KERNEL = ("sys", "sysrq-trigger", "irq", "bus")
NOEXEC = MS_NOSUID | MS_NODEV | MS_NOEXEC
CAP_VERSION_3 = 0x20080522
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox setup: {what}: {os.strerror(err)}")


def mount(src, dst, fstype, flags, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


# how a bind is remounted: "ro" read-only; "rw" writable, running nothing; "dev" a device node
BIND_FLAGS = {"ro": MS_RDONLY | MS_NOSUID | MS_NODEV, "rw": NOEXEC, "dev": MS_NOSUID | MS_NOEXEC}


def bind(src, dst, kind):
    mount(src, dst, None, MS_BIND | MS_REC)
    locked = os.statvfs(src).f_flag & LOCKED_FLAGS
    mount(None, dst, None, MS_REMOUNT | MS_BIND | BIND_FLAGS[kind] | locked)


def protect_proc(proc):
    """The kernel-writing parts of a /proc, read-only: the code's uid is never the host's 0, but a
    file-system that refuses the write is the second wall (bubblewrap leaves them writable when its
    own probe of them fails)."""
    for part in PROC_KERNEL:
        path = f"{proc}/{part}"
        if os.path.exists(path):
            mount(path, path, None, MS_BIND | MS_REC)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | NOEXEC)


def harden_bwrap(writable):
    """bwrap on a root rank (run without a user namespace, with CAP_SYS_ADMIN kept for this step
    only): /proc's kernel parts read-only, the writable places noexec."""
    protect_proc("/proc")
    for path in writable:
        if os.path.isdir(path):
            mount(None, path, None, MS_REMOUNT | MS_BIND | NOEXEC)


def mount_point(path, is_dir):
    os.makedirs(path if is_dir else os.path.dirname(path), exist_ok=True)
    if not is_dir and not os.path.exists(path):
        open(path, "w").close()


def build_root(root):
    """Step 1: the new root holds only what the plan names."""
    new = root["dir"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the node
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for target, link in root["symlinks"]:
        os.symlink(target, new + link)
    # the private /tmp before the binds: a read-only folder under /tmp (agent.read_only_paths) is
    # bound onto it, rather than hidden by it (or failing its mount point)
    os.makedirs(new + "/tmp")
    mount("tmpfs", new + "/tmp", "tmpfs", NOEXEC, f"size={root['tmp_bytes']},mode=1777")
    for src, dst, kind in root["binds"]:
        mount_point(new + dst, os.path.isdir(src))
        bind(src, new + dst, kind)
    os.makedirs(new + "/proc")
    try:  # a container may hide parts of /proc, and then the kernel refuses a fresh one: not needed
        mount("proc", new + "/proc", "proc", NOEXEC)
    except OSError:
        pass
    else:
        protect_proc(new + "/proc")
    enter(new)
    # the tmpfs root itself read-only: the scratch folder and /tmp are the only writable places
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter(new):
    """pivot_root into `new` and detach the old root (chroot where the call number is unknown)."""
    os.chdir(new)
    number = PIVOT_ROOT.get(platform.machine())
    if number is None:
        os.chroot(".")
    else:
        check(libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")
        check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def set_limits(limits):
    """Step 2: each limit as (name, soft, hard); never above a hard limit already in force."""
    for name, soft, hard in limits:
        which = getattr(resource, name)
        _, current = resource.getrlimit(which)
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(which, (soft, hard))


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_privileges(uid):
    """Step 4. With an empty bounding set and no inheritable or ambient capabilities, exec() grants
    none, even to uid 0 of a user namespace; `uid` (also the gid, no supplementary groups) is the
    run's own unprivileged id on a root rank, None where the rank already is a user."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability this kernel knows; EPERM: none held (rlimits)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    none = (CapData * 2)()  # lowering one's own capabilities needs no privilege
    check(libc.capset(ctypes.byref(CapHeader(CAP_VERSION_3, 0)), none), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def children():
    """This process's live children, from /proc (those of a sub-reaper include the run's orphans)."""
    me, found = os.getpid(), []
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return found  # no /proc in a namespaces root: the pid namespace ends them instead
    for name in names:
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != b"Z":
            found.append(int(name))
    return found


def end_leftovers():
    """Step 5: kill what the code left running (a daemon that double-forked, a setsid'd child):
    as the run's sub-reaper every orphan is this process's child, until this process exits."""
    for _ in range(200):  # a fork bomb refills the list while we kill: until it is empty
        while True:  # reap what has ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        kids, killed = children(), 0
        for pid in kids:
            try:
                os.kill(pid, 9)
                killed += 1
            except OSError:
                pass
        if not killed:  # none left, or none this process may signal: the pid namespace ends them
            return


def loopback_up():
    """`unshare --net` leaves the new namespace's loopback down (bubblewrap brings it up): a
    socket binds to 127.0.0.1 all the same, but nothing can connect to it."""
    import fcntl
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def listen(spec, env):
    """Step 1b: a socket listening on a free port of 127.0.0.1 in this run's network namespace
    (the node's in rlimits mode), sent to the rank over spec["fd"]; its port goes into the code's
    environment variable spec["env"], in spec["url"] at "{port}"."""
    if spec["own_net"]:
        loopback_up()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    env[spec["env"]] = spec["url"].replace("{port}", str(sock.getsockname()[1]))
    with socket.socket(fileno=spec["fd"]) as channel:
        socket.send_fds(channel, [b"L"], [sock.fileno()])
    sock.close()  # the rank holds it now; the code gets none of this process's sockets


def main(plan):
    if plan["root"]:
        build_root(plan["root"])
    if plan["harden"]:
        harden_bwrap(plan["harden"])
    if plan.get("listen"):
        listen(plan["listen"], plan["env"])
    status_fd = plan["status_fd"]
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "not dumpable")
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "sub-reaper")
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)  # the code must not write the status line
        set_limits(plan["limits"])
        drop_privileges(plan["uid"])
        os.chdir(plan["cwd"])  # as the code's uid: the scratch folder is its, mode 0700
        os.execve(plan["argv"][0], plan["argv"], plan["env"])
    # This process waits (pid 1 of the pid namespace in the bwrap and namespaces modes: when it
    # exits, every process the code left behind is killed) and tells the sandbox how the code
    # ended, which wrappers blur (bwrap exits 128 + a signal, unshare fails to re-raise SIGXCPU).
    _, status, usage = os.wait4(pid, 0)
    end_leftovers()
    report = {"cpu_s": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["exit"] = os.WEXITSTATUS(status)
    os.write(status_fd, json.dumps(report).encode())
    os._exit(report.get("exit", 1))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
