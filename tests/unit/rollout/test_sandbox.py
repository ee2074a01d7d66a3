"""The sandbox for model-written code (verl_hpc/rollout/tools/sandbox.py, docs/sandbox.md).

Every mode runs here: bwrap (installed by slurm/devcluster/start.sh, which `make test` runs),
namespaces and rlimits. Each hostile program must end contained with the status that names what
stopped it, and a normal run right after must work. rlimits mode isolates nothing but limits: where
it lets a program read a file or connect, the test says so and checks that the docs and describe()
say so too.
"""
import os
import pathlib
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.multi_turn import SandboxConfig
from verl_hpc.rollout.tools import Sandbox, SandboxResult
from verl_hpc.rollout.tools import sandbox as sandbox_module

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODES = ("bwrap", "namespaces", "rlimits")
ISOLATED = ("bwrap", "namespaces")
LIMITS = dict(cpu_time_s=1, wall_time_s=20, memory_mb=256, max_processes=8, max_output_bytes=4096)


@pytest.fixture(scope="module", params=MODES)
def box(request, tmp_path_factory):
    """One sandbox per mode (a missing bwrap fails here: CI installs it, nothing skips)."""
    return Sandbox(mode=request.param, scratch_root=str(tmp_path_factory.mktemp("scratch")), **LIMITS)


def run(box, code, **kw) -> SandboxResult:
    result = box.run_python(code, **kw)
    assert result.mode == box.mode
    return result


def next_run_works(box):
    result = run(box, "print(6*7)")
    assert (result.stdout, result.status, result.exit_code, result.ok) == ("42\n", "ok", 0, True), result


def test_reading_a_file_outside_scratch(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-secret")
    readme = ROOT / "README.md"
    result = run(box, f"print(open({str(secret)!r}).read())\nprint(open({str(readme)!r}).read()[:10])")
    if box.mode in ISOLATED:  # neither file exists in the sandbox's view
        assert result.status == "error" and "FileNotFoundError" in result.stderr, result
        assert "hunter2" not in result.stdout + result.stderr
    else:  # said plainly: rlimits mode does not hide the user's files
        assert result.ok and result.stdout == "hunter2-secret\n# verl_hpc\n", result
        assert "does NOT stop network access or reading the user's files" in box.describe()
        assert "does **not** stop" in (ROOT / "docs" / "sandbox.md").read_text()
    next_run_works(box)


def test_writing_outside_scratch(box, tmp_path):
    target = tmp_path / "written.txt"
    if box.mode not in ISOLATED:  # rlimits writes wherever the user may: nothing to contain
        assert "does NOT stop" in box.describe()
        return next_run_works(box)
    result = run(box, f"open({str(target)!r}, 'w').write('x')")
    assert result.status == "error" and "FileNotFoundError" in result.stderr, result
    assert not target.exists()
    # a folder the sandbox does see (the interpreter's) is read-only
    inside = pathlib.Path(sys.base_prefix).resolve() / "verl_hpc_sandbox_write_test"
    try:
        result = run(box, f"open({str(inside)!r}, 'w').write('x')")
        assert result.status == "denied" and "Read-only file system" in result.stderr, result
        assert not inside.exists()
    finally:
        inside.unlink(missing_ok=True)
    next_run_works(box)


def test_network_connection(box):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        result = run(box, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('in')")
        try:
            server.accept()[0].close()
            connected = True
        except socket.timeout:
            connected = False
    if box.mode in ISOLATED:  # an empty network namespace: unreachable (namespaces) or refused (bwrap's lo)
        assert result.status == "denied" and not connected, result
        assert "Network is unreachable" in result.stderr or "Connection refused" in result.stderr
    else:
        assert result.ok and connected, "rlimits mode does not stop the network, and says so"
        assert "network" in box.describe()
    next_run_works(box)


def test_fork_bomb(box):
    result = run(box, "import os\nwhile True:\n    os.fork()")
    assert result.status == "process_limit" and result.exit_code != 0, result
    assert "process limit (8)" in result.stderr
    next_run_works(box)


def test_allocating_past_the_memory_limit(box):
    result = run(box, "x = bytearray(8 * 2**30)\nprint('allocated')")
    assert result.status == "memory_limit" and "allocated" not in result.stdout, result
    next_run_works(box)


def test_printing_without_end(box):
    result = run(box, "while True:\n    print('y' * 1000)")
    assert result.status == "output_limit" and result.exit_code is None, result
    assert 0 < len(result.stdout) <= LIMITS["max_output_bytes"]
    next_run_works(box)


def test_a_file_past_max_file_bytes(box):
    result = run(box, "open('big', 'wb').write(bytes(2 * 2**20))")  # max_file_bytes: 1 MiB (default)
    assert result.status == "error" and "File too large" in result.stderr, result
    next_run_works(box)


def test_busy_loop_hits_the_cpu_limit(box):
    result = run(box, "while True:\n    pass")
    assert result.status == "cpu_limit" and result.exit_code is None, result
    assert result.seconds < LIMITS["wall_time_s"]
    next_run_works(box)


def test_sleeping_forever_hits_the_wall_clock(box):
    result = run(box, "import time\ntime.sleep(3600)", wall_time_s=1)
    assert result.status == "timeout" and result.exit_code is None, result
    assert 1 <= result.seconds < 5
    next_run_works(box)


def test_a_process_left_behind_is_killed(box):
    """A child in a session of its own (out of the run's process group) dies with the run."""
    result = run(box, "import subprocess\nsubprocess.Popen(['sleep', '3601.25'], start_new_session=True)\n"
                      "print('spawned')")
    assert result.ok and result.stdout == "spawned\n", result
    left = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == "sleep\x003601.25\x00"]
    assert not left, f"sleep 3601.25 survived the run: pids {left}"


def _cmdline(pid: str) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def test_environment_stdin_and_interpreter(box, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "tok-secret")
    result = run(box, "import os, sys\nprint(sorted(os.environ))\nprint(repr(sys.stdin.read()))\n"
                      "print(sys.prefix)\nprint(sys.flags.isolated)")
    env, stdin, prefix, isolated = result.stdout.splitlines()
    assert result.ok and "HF_TOKEN" not in env and "tok-secret" not in result.stdout
    assert stdin == "''" and isolated == "1"
    assert prefix == os.path.realpath(sys.base_prefix) != sys.prefix  # the base Python, not the venv


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


def test_a_mode_this_node_lacks_is_one_config_error(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"sandbox.mode = bwrap: bwrap is not installed on this node"):
        Sandbox(mode="bwrap")
    assert Sandbox(mode="auto", **LIMITS).mode == "rlimits"  # nothing else left, said in describe()


def test_a_scratch_root_that_is_no_folder_is_one_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    for bad in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(ConfigError, match=rf"sandbox.scratch_root = '{bad}': not a writable folder"):
            Sandbox(mode="rlimits", scratch_root=str(bad))


def test_from_config():
    box = Sandbox.from_config(SandboxConfig(mode="rlimits", cpu_time_s=2.0, memory_mb=300, max_processes=5))
    assert (box.mode, box.cpu_time_s, box.memory_mb, box.max_processes) == ("rlimits", 2.0, 300, 5)
    assert "2 s CPU" in box.describe() and "300 MiB" in box.describe()
