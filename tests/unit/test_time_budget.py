"""The per-test time budget (tests/time_budget.py): its table names what exists, and a pytest run
with its hooks fails a test over its budget, and only that test, charging a shared fixture to itself."""
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import time_budget
from time_budget import SLOWEST, TIER_BUDGET_S

TESTS = Path(time_budget.__file__).resolve().parent


def test_every_entry_names_what_exists_with_a_reason_and_more_than_its_tier():
    assert time_budget.stale_entries() == []
    for key, (seconds, why) in SLOWEST.items():
        assert len(why.split()) >= 5, key  # a reason, not a word
        assert seconds > 0, key
        if not key.startswith("fixture:"):
            tier = key.split("/")[1]
            assert seconds > TIER_BUDGET_S[tier], f"{key}: within its tier's budget, needs no entry"


def test_a_renamed_test_is_a_stale_entry(monkeypatch):
    monkeypatch.setitem(SLOWEST, "tests/unit/test_time_budget.py::test_gone", (30, "a test that was renamed"))
    monkeypatch.setitem(SLOWEST, "fixture:no_such_fixture", (30, "a fixture that was removed"))
    assert time_budget.stale_entries() == ["tests/unit/test_time_budget.py::test_gone", "fixture:no_such_fixture"]


def test_budget_by_tier_entry_and_scale(monkeypatch):
    monkeypatch.delenv("VERL_HPC_TIME_BUDGET_SCALE", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)  # this test may run on a worker
    assert time_budget.budget("tests/jobs/test_x.py::test_y", "jobs")[0] == TIER_BUDGET_S["jobs"]
    key = next(k for k in SLOWEST if not k.startswith("fixture:"))
    assert time_budget.budget(key + "[a-b]", "dist")[0] == SLOWEST[key][0]  # parameters: the same entry
    assert time_budget.over("tests/unit/t.py::f", "unit", TIER_BUDGET_S["unit"] - 1) is None
    line = time_budget.over("tests/unit/t.py::f", "unit", TIER_BUDGET_S["unit"] + 1)
    assert line.startswith("time budget: tests/unit/t.py::f took ") and "the unit tier's budget" in line
    monkeypatch.setenv("VERL_HPC_TIME_BUDGET_SCALE", "2")
    assert time_budget.over("tests/unit/t.py::f", "unit", TIER_BUDGET_S["unit"] + 1) is None
    monkeypatch.setenv("VERL_HPC_TIME_BUDGET_SCALE", "0")  # off
    assert time_budget.over("tests/unit/t.py::f", "unit", 10 ** 6) is None


def test_xdist_workers_side_by_side_stretch_the_budgets(monkeypatch):
    monkeypatch.delenv("VERL_HPC_TIME_BUDGET_SCALE", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert time_budget.budget("tests/jobs/test_x.py::test_y", "jobs")[0] == 2 * TIER_BUDGET_S["jobs"]
    assert time_budget.over("tests/unit/t.py::f", "unit", 2 * TIER_BUDGET_S["unit"] - 1) is None
    assert time_budget.over("tests/unit/t.py::f", "unit", 2 * TIER_BUDGET_S["unit"] + 1) is not None


def test_the_load_beyond_the_suites_own_stretches_the_budgets(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.setattr(time_budget.os, "cpu_count", lambda: 2)
    assert time_budget.load_factor([0.5, 3.9]) == 1.0  # the suite's own ranks on 2 cores
    assert time_budget.load_factor([20.0, 20.0]) == 5.0  # another run beside this one
    assert time_budget.over("tests/unit/t.py::f", "unit", 3 * TIER_BUDGET_S["unit"], load=5.0) is None
    assert "x 2.0 for the machine's load" in time_budget.over("tests/unit/t.py::f", "unit",
                                                              3 * TIER_BUDGET_S["unit"], load=2.0)


@pytest.mark.heavy
def test_a_run_fails_the_test_over_its_budget_and_charges_shared_fixtures_apart(tmp_path):
    # budgets scaled to 1 s (the unit tier's 20 s x 0.05): the shared fixture (0.6 s) and the test
    # that builds it (0.5 s) are each within theirs, together over; the slow test (1.5 s) and the slow
    # shared fixture (1.3 s) are over
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import os
        import sys
        os.getloadavg = lambda: (0.0, 0.0, 0.0)  # a quiet machine, whatever this one's load
        sys.path.insert(0, {str(TESTS)!r})
        from time_budget import pytest_fixture_setup, pytest_runtest_makereport, pytest_runtest_protocol
        """))
    (tmp_path / "test_it.py").write_text(textwrap.dedent("""
        import time
        import pytest

        @pytest.fixture(scope="module")
        def shared():
            time.sleep(0.6)

        def test_builds_the_shared_fixture(shared):
            time.sleep(0.5)

        def test_slow():
            time.sleep(1.5)

        @pytest.mark.gpu
        def test_slow_on_a_gpu():  # no budget: compilation and CUDA start-up on the GPU machine
            time.sleep(1.5)

        def test_quick(shared):
            pass

        @pytest.fixture(scope="session")
        def slow_shared():
            time.sleep(1.3)

        def test_builds_a_slow_shared_fixture(slow_shared):
            pass
        """))
    env = {"VERL_HPC_TIME_BUDGET_SCALE": str(1 / TIER_BUDGET_S["unit"]), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "test_it.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"2 failed, 3 passed", r.stdout), r.stdout
    assert "FAILED test_it.py::test_slow - time budget" in r.stdout, r.stdout  # the test is the one named
    assert re.search(r"time budget: test_it.py::test_slow took \d+ s of setup and call, over the unit tier's "
                     r"budget of 1 s", r.stdout), r.stdout
    # a shared fixture over its own budget fails the test that built it, naming the fixture
    assert re.search(r"time budget: fixture:slow_shared took \d+ s of setup, over the unit tier's budget of 1 s",
                     r.stdout), r.stdout


def test_a_quick_unit_test_has_make_checks_budget(monkeypatch):
    """A unit test make check runs (neither heavy nor long) has 5 s; a heavy one the tier's 20 s."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    monkeypatch.setenv("VERL_HPC_TIME_BUDGET_SCALE", "1")
    node = "tests/unit/test_x.py::test_y"
    line = time_budget.over(node, "unit", 6.0, quick=True)
    assert line and "make check's" in line and "mark it `heavy`" in line
    assert time_budget.over(node, "unit", 6.0, quick=False) is None
    assert time_budget.over(node, "unit", 4.0, quick=True) is None
    assert time_budget.over("tests/jobs/test_x.py::test_y", "jobs", 6.0, quick=True) is None  # unit tier only
    slow = next(k for k in SLOWEST if k.startswith("tests/unit/"))  # its own budget, its own advice
    line = time_budget.over(slow, "unit", 10 ** 6, quick=True)
    assert "SLOWEST" in line and "heavy" not in line
