"""Hostile programs x sandbox modes x kinds of rank (sandbox_payloads.py), against the table of
docs/sandbox.md: every cell the docs call held is held, every certain escape the docs admit
happens, and the docs' table is the one the tests check.

The suite's ranks run as root (CI, the dev cluster): the root column runs in this process. The
user column runs the same payloads from a process of an unprivileged uid, as a user's job would.
"""
import json
import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

from sandbox_payloads import EXPECT_COLUMNS, LIMITS, MODES, PAYLOADS, expected, run_payloads, wrong

from verl_hpc.rollout.tools import Sandbox
from verl_hpc.rollout.tools.sandbox_cgroups import RunCgroups

ROOT = pathlib.Path(__file__).resolve().parents[3]
HERE = pathlib.Path(__file__).resolve().parent
USER_UID = 64999  # no account: a user's rank as the sandbox sees one
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by any uid, unlike a Python under /root


@pytest.fixture
def scratch_root():
    """A scratch root the runs' own uids can reach (pytest's tmp_path is under a 0700 folder)."""
    folder = tempfile.mkdtemp(prefix="verl_hpc_escapes_")
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder)


def _root_box(mode, scratch_root):
    # rlimits mode on a root rank runs the code as its own uid, which must read the interpreter:
    # the job's base Python here lives under /root (0700), so the system one is named
    python = SYSTEM_PYTHON if mode == "rlimits" else ""
    return Sandbox(mode=mode, scratch_root=scratch_root, python=python, **LIMITS)


@pytest.mark.heavy
def test_root_rank(scratch_root):
    assert os.geteuid() == 0, "the suite's ranks run as root (CI, the dev cluster): this column needs it"
    assert {"pids", "memory", "cpu"} <= set(RunCgroups.bases()), (
        "root on this node can make no per-run cgroup for some controller: the memory cells need one",
        RunCgroups.bases())
    records = run_payloads(lambda mode: _root_box(mode, scratch_root), "root")
    assert not wrong(records), "\n".join(wrong(records))
    assert os.listdir(scratch_root) == []  # every run's folder removed


@pytest.mark.heavy
def test_user_rank(scratch_root):
    """The same payloads from a process of an unprivileged uid, on a copy of the sandbox's source
    (the uid may not read the checkout or the venv: CI may clone under /root)."""
    top = pathlib.Path(scratch_root)
    src, scratch = top / "src", top / "scratch"
    shutil.copytree(ROOT / "verl_hpc", src / "verl_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HERE / "sandbox_payloads.py", src)
    scratch.mkdir()
    os.chown(scratch, USER_UID, USER_UID)
    proc = subprocess.run(["setpriv", f"--reuid={USER_UID}", f"--regid={USER_UID}", "--clear-groups",
                           SYSTEM_PYTHON, "-I", str(src / "sandbox_payloads.py"), str(src), str(scratch)],
                          capture_output=True, text=True, timeout=600, env={"PATH": os.environ["PATH"]}, cwd=top)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["mode"], r["rank"]) for r in records} == {(m, "user") for m in MODES}
    assert not wrong(records), "\n".join(wrong(records))


def test_the_docs_table_is_the_one_tested():
    text = (ROOT / "docs" / "sandbox.md").read_text()
    section = text.split("## What each mode contains", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    header, body = rows[0], rows[1:]
    assert [c.strip() for c in header.strip("|").split("|")][1:] == [f"{m} ({r})" for m, r in EXPECT_COLUMNS]
    table = {}
    for line in body:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0]] = cells[1:]
    assert list(table) == [p.name for p in PAYLOADS]
    for p in PAYLOADS:
        want = ["held" if expected(p.name, m, r) == "held" else "**open**" for m, r in EXPECT_COLUMNS]
        assert table[p.name] == want, (p.name, table[p.name], want)


def test_code_is_never_run_as_root(scratch_root):
    for mode in MODES:
        box = _root_box(mode, scratch_root)
        result = box.run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
        uid, gid, groups = result.stdout.split(" ", 2)
        assert result.ok and int(uid) == int(gid) >= box.uid_base and groups == "[]\n", result
        assert "unprivileged uid" in box.describe()


@pytest.mark.heavy
def test_each_run_has_its_own_uid(scratch_root):
    box = _root_box("bwrap", scratch_root)
    uids = {box.run_python("import os\nprint(os.getuid())").stdout for _ in range(3)}
    assert len(uids) == 3 and all(box.uid_base <= int(u) < box.uid_base + (1 << 24) for u in uids)


@pytest.mark.heavy
def test_cpu_time_is_counted_over_the_tree_without_a_cgroup(scratch_root, monkeypatch):
    """Where no cgroup counts the run (a user's rank), the watcher sums the process tree."""
    box = _root_box("namespaces", scratch_root)
    monkeypatch.setattr(box, "_cgroups", {k: v for k, v in box._cgroups.items() if k != "cpu"})
    code = next(p.code for p in PAYLOADS if p.name == "busy loops in 4 children")
    result = box.run_python(code)
    assert result.status == "cpu_limit" and "ESCAPED" not in result.stdout, result
    assert "summed over the process tree" in box.describe()
