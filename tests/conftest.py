"""Shared pytest setup.

- Each test gets its tier's marker from its folder (tests/unit -> unit, tests/jobs -> job,
  tests/dist -> dist, tests/slurm -> slurm, tests/container -> container): `make check` and
  `make test` select by marker, and a new test file needs no `pytestmark` line for it.
- GPU tests skip only where no CUDA device exists; nothing else skips.
- The tiny model and the synthetic task are built once per run (`tiny_assets`), the SFT warm
  start too (`warm_assets`), by the first pytest-xdist worker that needs them; every test of every
  worker shares the same folder (and adds nothing to it but files one module builds once).
- Every test has a time budget (tests/time_budget.py, whose hooks are imported here): over it, it fails.
- `long` (soak runs, chains of launches, two-node jobs) is left to `make test-long`; `make test`
  runs every tier on 3 pytest-xdist workers (one thread each), a module's tests on one worker.
- Before each test the worker's heap is collected and frozen (`gc.freeze`), so that the full
  collections a test's libraries ask for walk what the test made, not the million objects of the
  imported libraries.
- A test of Ctrl-C asks for `terminal_sigint`: the suite may be started with SIGINT ignored (a
  shell's background job, `nohup make test &`, some CI runners), and no verdict may depend on that.
- Each test that touches vLLM gets the marker `vllm` (`make test-vllm-range` runs them on the other
  verified vLLM release), and one that touches vLLM without it fails (tests/vllm_selection.py).
"""
import contextlib
import fcntl
import os
import signal
import sys
from pathlib import Path

import pytest

import vllm_selection
from time_budget import pytest_fixture_setup, pytest_runtest_makereport, pytest_runtest_protocol  # noqa: F401
from verl_hpc.launcher.environment import REPRODUCIBLE_CPU
from verl_hpc.launcher.startup_imports import freeze_heap

# Jobs run in this process (tests/jobs.py, run_here) compute with this process's MKL: the same
# reproducible mode a rank gets, set before anything imports torch, so that the shared SFT warm start
# (and every figure a learning test asserts) is the same in every session.
for _name, _value in REPRODUCIBLE_CPU.items():
    os.environ.setdefault(_name, _value)
# `make test` runs on 2 pytest-xdist workers: one thread each in the tests' own process, so that the two do
# not share the 2 cores 4 ways (a test's verdict holds at any thread count: `make test-portable`)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = {"unit": "unit", "jobs": "job", "dist": "dist", "slurm": "slurm", "container": "container"}
# Under pytest-xdist's `--dist loadscope` (make test) a module's tests run on one worker, so that a
# dist module's fixture (a launch of 2-4 ranks) is built once. (Not `loadgroup`: xdist 3.8 groups by
# renaming `item._nodeid`, which pytest 9 no longer reads, so its groups silently fall apart.)
# Collected first, and handed out in this order (make test: --no-loadscope-reorder), so that the
# longest modules start first and the unit tests fill in at the end.
FIRST = ("slurm", "dist", "jobs")


def pytest_itemcollected(item):
    """The folder's marker, before `-m` selects (pytest deselects after collection)."""
    folder = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
    if folder not in FOLDER_MARKERS:
        raise pytest.UsageError(f"{item.nodeid}: tests live in one of the tier folders "
                                f"{', '.join(f'tests/{f}' for f in FOLDER_MARKERS)}")
    item.add_marker(FOLDER_MARKERS[folder])
    vllm_selection.mark(item)  # `vllm`: make test-vllm-range runs it (tests/vllm_selection.py)
    if "terminal_sigint" in getattr(item, "fixturenames", ()):
        item.add_marker("signals")  # make test-portable runs them with SIGINT ignored


def pytest_configure(config):
    config.pluginmanager.register(vllm_selection.Watch(), "vllm_selection")  # the `vllm` marker's check


@pytest.fixture(autouse=True)
def _heap_frozen():
    """Collect, then freeze, what the worker holds before each test. vLLM asks for a full garbage
    collection three times while it builds an engine and twice when it shuts one down, the rollout's
    shutdown and the job's end once each: in a worker that has imported torch, transformers,
    Megatron-Core and vLLM, each walks about a million objects, 0.5 s of CPU, and a job module of
    seven in-process vLLM jobs spent 28 s of its 48 in them. Frozen objects are left out of the cyclic collector's walks (they are still freed
    when their last reference goes); what the test itself makes is collected as before. vLLM
    unfreezes the whole heap when it shuts an engine down: the next test freezes it again. The
    collection first, so that no garbage of an earlier test is frozen."""
    freeze_heap()  # and unfrozen at the worker's exit, as a rank's is
    yield


@pytest.fixture(autouse=True)
def _default_dtype_kept():
    """A test that leaves torch's default dtype changed fails here, by name, and the next test on the
    worker starts from float32 again: the leak otherwise shows up as an unrelated test's dtype error
    (vLLM's model loader sets the default dtype while it builds a model)."""
    torch = sys.modules.get("torch")  # not imported for it: the Slurm tier's tests never need torch
    before = torch.get_default_dtype() if torch else None  # None: float32, torch's own at import
    yield
    torch = sys.modules.get("torch")
    if torch is None:
        return
    before = before or torch.float32
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(f"this test left torch's default dtype at {after} (was {before})")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests either
        return False


def pytest_collection_modifyitems(config, items):
    tier = {m: k for k, m in enumerate(FIRST)}
    items.sort(key=lambda item: tier.get(Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0], len(FIRST)))
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        # the marker, not `"gpu" in item.keywords`: keywords also hold the names of the folders
        # above the test (a checkout in a folder named gpu would skip every test)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


def _wait_for_text(folder, pattern, needle, proc=None, timeout=180) -> float:
    """Poll files matching `pattern` (recursive glob under `folder`) until one contains `needle`;
    returns the time it was seen. Fails (never hangs) if the process ends first or time runs out."""
    import time
    from pathlib import Path

    end = time.time() + timeout
    while time.time() < end and (proc is None or proc.poll() is None):
        for f in Path(folder).glob(pattern):
            if needle in f.read_text(errors="replace"):
                return time.time()
        time.sleep(0.2)
    logs = "".join(f"\n--- {f}\n{f.read_text(errors='replace')[-2000:]}"
                   for f in sorted(Path(folder).rglob("*")) if f.is_file())
    raise AssertionError(f"'{needle}' never appeared in {folder}/{pattern}{logs}")


@pytest.fixture
def terminal_sigint():
    """SIGINT as a command started from a terminal has it, whatever this process inherited: Python's
    handler (KeyboardInterrupt) here, and the default disposition in every process the test starts
    (exec resets a handled signal to the default, while an ignored one stays ignored: a shell's
    background job starts with SIGINT ignored, and Python then installs no handler of its own)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def wait_for_text():
    return _wait_for_text


def _smoke_job(tmp_path, *overrides, local: bool = True):
    """`python -m verl_hpc.submit configs/smoke.yaml` started in the background (stdout, stderr
    piped), its output and logs under tmp_path (out/, logs/<job>)."""
    import subprocess
    import sys
    from pathlib import Path

    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/smoke.yaml", *(["--local"] if local else []),
           f"trainer.output_dir={tmp_path}/out", f"slurm.log_dir={tmp_path}/logs/%j", *overrides]
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _failure_after(proc, folder, pattern, needle, timeout=120):
    """Wait for `needle` in the job's logs (the moment a rank dies or hangs on purpose), then for
    the job to end; returns (stdout, stderr, seconds from the needle to the end). The process is
    killed whatever happens, so a job that does not fail cannot outlive the test."""
    import time

    try:  # the clock starts at the failure, not at launch (start-up time varies with load)
        seen = _wait_for_text(folder, pattern, needle, proc)
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return out, err, time.time() - seen


@pytest.fixture(scope="session")  # plain functions: any fixture may use them, a module's too
def smoke_job():
    return _smoke_job


@pytest.fixture(scope="session")
def failure_after():
    return _failure_after


@pytest.fixture
def recorded(monkeypatch):
    """Every call the agent endpoint records, seen where it is recorded (independently of the runner
    that turns them into training rows): a list that fills as the runs call."""
    from verl_hpc.rollout.agents import service

    calls = []
    real = service.Session.record

    def record(self, call, chat=None, reused=False):
        calls.append(call)
        real(self, call, chat, reused)

    monkeypatch.setattr(service.Session, "record", record)
    return calls


@contextlib.contextmanager
def _first_builds(path: Path):
    """Held while `path` is built: the pytest-xdist workers of one run share it, the first to come
    builds it and the others wait for it (the builders skip what exists), instead of each worker
    building its own (the SFT warm start is 2 minutes of CPU)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield path


def _run_folder(tmp_path_factory) -> Path:
    """The run's temporary folder, shared by its xdist workers (each has its own popen-gwN in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The 2-layer tiny model and the synthetic task (tests/jobs.py), built once per run. Read
    only: tests write their outputs in their own folders."""
    from jobs import make_assets

    with _first_builds(_run_folder(tmp_path_factory) / "assets") as root:
        return make_assets(root)


@pytest.fixture(scope="session")
def warm_assets(tiny_assets):
    """`tiny_assets` plus the SFT warm start under `sft/hf` (about 40% greedy accuracy)."""
    from jobs import warm_start

    with _first_builds(tiny_assets / "sft"):
        warm_start(tiny_assets)
    return tiny_assets
