"""The sandbox for model-written code (verl_hpc/rollout/tools/sandbox.py, docs/sandbox.md): its
limits, its environment, its modes and their choice. Every mode runs here: bwrap (installed by
slurm/devcluster/start.sh, which `make test` runs), namespaces and rlimits. The hostile programs
(files, network, kernel settings, memory, CPU, forged statuses, ...) against every mode are in
test_sandbox_escapes.py, with the docs' table of what each mode contains.
"""
import logging
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
from sandbox_payloads import LIMITS, MODES

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.multi_turn import SandboxConfig
from verl_hpc.rollout.tools import Sandbox, SandboxResult
from verl_hpc.rollout.tools import sandbox as sandbox_module

SYSTEM_PYTHON = "/usr/bin/python3"  # rlimits on a root rank: an interpreter any uid may read


@pytest.fixture(scope="module")
def scratch_root():
    """A scratch root the runs' own uids can reach (pytest's tmp_path is under a 0700 folder)."""
    folder = tempfile.mkdtemp(prefix="verl_hpc_sandbox_test_")
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture(scope="module", params=MODES)
def box(request, scratch_root):
    """One sandbox per mode (a missing bwrap fails here: CI installs it, nothing skips)."""
    python = SYSTEM_PYTHON if request.param == "rlimits" else ""
    return Sandbox(mode=request.param, scratch_root=scratch_root, python=python, **LIMITS)


def run(box, code, **kw) -> SandboxResult:
    result = box.run_python(code, **kw)
    assert result.mode == box.mode
    return result


def next_run_works(box):
    result = run(box, "print(6*7)")
    assert (result.stdout, result.status, result.exit_code, result.ok) == ("42\n", "ok", 0, True), result


@pytest.mark.heavy
def test_a_file_past_max_file_bytes(box):
    result = run(box, "open('big', 'wb').write(bytes(2 * 2**20))")  # max_file_bytes: 1 MiB (default)
    assert result.status == "error" and "File too large" in result.stderr, result
    next_run_works(box)


def test_sleeping_forever_hits_the_wall_clock(box):
    result = run(box, "import time\ntime.sleep(3600)", wall_time_s=1)
    assert result.status == "timeout" and result.exit_code is None, result
    assert 1 <= result.seconds < 5
    next_run_works(box)


def test_environment_stdin_and_interpreter(box, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "tok-secret")
    result = run(box, "import os, sys\nprint(sorted(os.environ))\nprint(repr(sys.stdin.read()))\n"
                      "print(sys.prefix)\nprint(sys.flags.isolated)")
    env, stdin, prefix, isolated = result.stdout.splitlines()
    assert result.ok and "HF_TOKEN" not in env and "tok-secret" not in result.stdout
    assert stdin == "''" and isolated == "1"
    if box.mode != "rlimits":  # the base Python, not the venv (rlimits here names the system one)
        assert prefix == os.path.realpath(sys.base_prefix) != sys.prefix


def test_many_runs_at_once_each_with_its_own_scratch(box):
    code = ("import os\nopen('mine.txt', 'w').write(str({i}))\n"
            "print(open('mine.txt').read(), sorted(os.listdir('.')))")
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: run(box, code.format(i=i)), range(12)))
    assert [r.stdout for r in results] == [f"{i} ['mine.txt']\n" for i in range(12)], results
    assert os.listdir(box.scratch_root) == []  # every run's folder removed


def test_auto_takes_the_strongest_mode_and_says_which(caplog):
    caplog.set_level("INFO", logger="verl_hpc.rollout.tools.sandbox")
    box = Sandbox(**LIMITS)
    assert box.mode == "bwrap"
    assert "mode bwrap" in box.describe() and "pids cgroup" in box.describe()
    assert any("auto -> bwrap" in r.getMessage() for r in caplog.records)


def test_auto_says_in_one_warning_that_it_fell_back(monkeypatch, caplog):
    which = shutil.which
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None if name == "bwrap" else which(name))
    caplog.set_level("INFO", logger="verl_hpc.rollout.tools.sandbox")
    assert Sandbox(**LIMITS).mode == "namespaces"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["sandbox: mode auto -> namespaces, not the stronger bwrap: bwrap is not installed on this node"]


def test_auto_never_falls_back_to_limits_only_on_a_root_rank(monkeypatch, scratch_root):
    assert os.geteuid() == 0  # the suite's ranks run as root
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"sandbox.mode = auto: no mode that contains model code runs on this "
                                          r"node \(bwrap: bwrap is not installed on this node; namespaces: unshare "
                                          r"is not installed on this node\), and the rank runs as root: .*"
                                          r"sandbox.allow_limits_only=true"):
        Sandbox(**LIMITS)
    box = Sandbox(allow_limits_only=True, python=SYSTEM_PYTHON, scratch_root=scratch_root, **LIMITS)
    assert box.mode == "rlimits" and "does NOT stop" in box.describe()


def test_a_mode_this_node_lacks_is_one_config_error(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"sandbox.mode = bwrap: bwrap is not installed on this node"):
        Sandbox(mode="bwrap")


@pytest.mark.parametrize("mode", ["auto", "bwrap", "namespaces"])
@pytest.mark.parametrize("field, value, status", [("max_output_bytes", 2, "output_limit"),
                                                  ("memory_mb", 4, "memory_limit")])
def test_a_trial_stopped_by_a_users_limit_names_the_limit(mode, field, value, status):
    """print(6*7) stopped by the user's own limit is the limit's fault, not the mode's: auto does not
    quietly take a weaker mode for it (it once fell back to rlimits for max_output_bytes=2)."""
    limits = {**LIMITS, field: value}
    with pytest.raises(ConfigError, match=rf"sandbox.{field} = {value}: the sandbox's trial run \(print\(6\*7\), "
                                          rf"mode bwrap|namespaces\) was stopped by this limit \({status}\); raise it"):
        Sandbox(mode=mode, **limits)


def test_rlimits_on_a_root_rank_needs_an_interpreter_any_uid_reads():
    """The job's base Python here lives under /root (0700): the code's own uid cannot run it."""
    if not sys.base_prefix.startswith("/root/"):
        pytest.fail(f"this test needs the suite's Python under /root (as on CI); it is at {sys.base_prefix}")
    with pytest.raises(ConfigError, match=r"sandbox.mode = rlimits: a trial run under .* failed \(PermissionError.*"
                                          r"e.g. sandbox.python=/usr/bin/python3\)"):
        Sandbox(mode="rlimits", **LIMITS)


def test_a_scratch_root_that_is_no_folder_is_one_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    for bad in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(ConfigError, match=rf"sandbox.scratch_root = '{bad}': not a writable folder"):
            Sandbox(mode="namespaces", scratch_root=str(bad))
    with pytest.raises(ConfigError, match=r"sandbox.python = '/nope/python': not an executable file"):
        Sandbox(mode="namespaces", python="/nope/python")


def test_model_text_with_lone_surrogates_is_a_run_not_an_exception(box):
    """JSON lets a model write "\\ud800"; such code reaches the sandbox as a backslash escape."""
    result = run(box, 'print("\ud800")')  # printing it fails in the program, as in any Python
    assert result.status == "error" and "UnicodeEncodeError" in result.stderr, result
    next_run_works(box)


def test_from_config(scratch_root):
    box = Sandbox.from_config(SandboxConfig(mode="namespaces", cpu_time_s=2.0, memory_mb=300, max_processes=5,
                                            max_open_files=32, scratch_root=scratch_root))
    assert (box.mode, box.cpu_time_s, box.memory_mb, box.max_processes, box.max_open_files) == \
        ("namespaces", 2.0, 300, 5, 32)
    assert "2 s CPU" in box.describe() and "300 MiB" in box.describe() and "32 open files" in box.describe()


@pytest.mark.parametrize("uid_base", [1000, 2**32 - 2])
def test_uid_base_outside_the_unprivileged_range_is_refused(uid_base):
    problems = SandboxConfig(uid_base=uid_base).check(None)
    assert any(p.startswith(f"sandbox.uid_base = {uid_base}: expected 65536 to ") for p in problems), problems


def test_root_of_a_user_namespace_is_sandboxed_as_a_user():
    """A rootless container's uid 0 is another uid of the node: no uid of its own to drop to."""
    assert os.geteuid() == 0
    assert sandbox_module._host_root("         0          0 4294967295\n")
    assert not sandbox_module._host_root("         0       1000          1\n")
    assert not sandbox_module._host_root("         0     100000      65536\n")
