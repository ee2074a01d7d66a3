"""Each GPU check's own time budget (gpu_check/kit.py, table.py, vllm_set.py) and `make gpu-all`'s
continuation of a check step killed at its limit (all.py): a check that runs too long costs that
check, not the set. Before, the vLLM step had one 240 s limit for every engine build of the set, and
a check that ran over it took the ones after it along."""
import json
import sys
import textwrap
import time

import pytest

from verl_hpc.gpu_check import all as gpu_all
from verl_hpc.gpu_check import vllm_set
from verl_hpc.gpu_check.__main__ import needs_deterministic
from verl_hpc.gpu_check.kit import Check, Kit, run_checks
from verl_hpc.gpu_check.table import TableFile, continuation

pytestmark = pytest.mark.unit
quiet = lambda *a, **k: None  # noqa: E731 - the runners' progress lines


def _sleeps(seconds):
    def run(kit):
        time.sleep(seconds)
        return f"slept {seconds} s"
    return run


def test_a_check_past_its_budget_is_stopped_and_the_next_one_runs(tmp_path):
    checks = [Check("slow", "", _sleeps(30), budget_s=0.5), Check("quick", "", _sleeps(0)),
              Check("after_slow", "", _sleeps(0), needs=("slow",))]
    start = time.monotonic()
    rows = run_checks(Kit(out=tmp_path, rehearsal=True), checks, log=quiet)
    assert time.monotonic() - start < 10
    assert [(c.name, st) for c, st, *_ in rows] == [("slow", "TIMEOUT"), ("quick", "PASS"), ("after_slow", "SKIPPED")]
    assert rows[0][2] == "stopped: ran past its budget of 0.5 s"
    assert 0.4 < rows[0][3] < 10  # its seconds are recorded
    assert (tmp_path / "slow.traceback.txt").is_file()


def test_a_check_that_catches_every_exception_is_still_stopped(tmp_path):
    """vLLM and the checks catch Exception in places: the budget's signal is not one."""
    def swallows(kit):
        for _ in range(300):
            try:
                time.sleep(0.1)
            except Exception:  # noqa: BLE001 - what the test is about
                pass
        return "never"

    rows = run_checks(Kit(out=tmp_path, rehearsal=True), [Check("c", "", swallows, budget_s=0.3)], log=quiet)
    assert rows[0][1] == "TIMEOUT"


def test_past_the_runs_deadline_the_checks_left_are_skipped(tmp_path):
    checks = [Check("a", "", _sleeps(30), budget_s=60), Check("b", "", _sleeps(0), budget_s=60)]
    rows = run_checks(Kit(out=tmp_path, rehearsal=True), checks, log=quiet, deadline=time.monotonic() + 0.5)
    assert [st for _, st, *_ in rows] == ["TIMEOUT", "SKIPPED"] and "out of time" in rows[1][2]


def test_the_vllm_set_gives_every_check_a_budget_and_the_step_their_sum():
    checks = vllm_set.checks()
    assert {c.name for c in checks} == set(vllm_set.ESTIMATE_S)
    assert all(c.budget_s == 2 * vllm_set.ESTIMATE_S[c.name] for c in checks)
    assert vllm_set.VLLM_STEP_S >= sum(vllm_set.ESTIMATE_S.values()) + vllm_set.STARTUP_S
    assert gpu_all.VLLM_LIMIT_S["vllm"] == vllm_set.VLLM_STEP_S
    step = {s.name: s for s in gpu_all.plan(gpu_all.ROOT, py="PY", wheels=None, rehearsal=False, only=["vllm"])}["vllm"]
    assert step.command[-2:] == ["--time-limit", str(int(vllm_set.VLLM_STEP_S - 15))]  # it stops itself first


def test_the_vllm_set_runs_as_a_job_runs_and_the_first_gpu_set_deterministic():
    assert needs_deterministic("all") and not needs_deterministic("vllm")


# ----------------------------------------------------------------------------- a run killed at its limit
CHECKS = [Check("setup", "", _sleeps(0)), Check("a", "", _sleeps(0), needs=("setup",)),
          Check("hangs", "", _sleeps(0), needs=("setup",)), Check("b", "", _sleeps(0), needs=("setup",)),
          Check("c", "", _sleeps(0))]


def _killed_table(out):
    """What a run killed while `hangs` ran leaves: setup and a done, hangs running, b and c not reached."""
    table = TableFile(out, [c.name for c in CHECKS])
    table.done([(CHECKS[0], "PASS", "ok", 1.0), (CHECKS[1], "FAIL", "no", 2.0)])
    table.started(CHECKS[2], 70.0)


def test_a_killed_run_is_continued_with_the_checks_it_did_not_reach_and_what_they_need(tmp_path):
    _killed_table(tmp_path)
    prior, only, planned = continuation(tmp_path, CHECKS)
    assert only == ["setup", "b", "c"] and planned == [c.name for c in CHECKS]
    assert [(r["check"], r["status"]) for r in prior] == [("setup", "PASS"), ("a", "FAIL"), ("hangs", "TIMEOUT")]
    assert "killed with its run at the run's limit (70 s)" in prior[2]["detail"]
    table = TableFile(tmp_path, planned, prior)
    rows = run_checks(Kit(out=tmp_path, rehearsal=True), CHECKS, only, log=quiet, on_row=table.done)
    assert [c.name for c, *_ in rows] == ["setup", "b", "c"]
    merged = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [(r["check"], r["status"]) for r in merged] == [("setup", "PASS"), ("a", "FAIL"), ("hangs", "TIMEOUT"),
                                                           ("b", "PASS"), ("c", "PASS")]


def test_continue_without_a_table_says_what_it_needs(tmp_path):
    with pytest.raises(ValueError, match=r"--continue: .*gpu_check.json does not exist; valid: the --out folder"):
        continuation(tmp_path, CHECKS)


@pytest.mark.heavy  # processes started and killed
def test_gpu_all_goes_on_after_a_check_step_is_killed_and_the_hang_costs_one_check(tmp_path, monkeypatch):
    """A stand-in for `python -m verl_hpc.gpu_check --set vllm`: its first process hangs in the
    second check where no budget reaches (as in C); all.py kills it at the step's limit, then
    starts it again with --continue, which runs the checks left."""
    script = tmp_path / "checks.py"
    script.write_text(textwrap.dedent("""
        import json, sys, time
        from pathlib import Path
        table = Path(sys.argv[1]) / "gpu_check.json"
        table.parent.mkdir(parents=True, exist_ok=True)
        if "--continue" not in sys.argv:
            table.write_text(json.dumps({"planned": ["a", "hangs", "b"], "running": {"check": "hangs", "limit_s": 1},
                                         "rows": [{"check": "a", "status": "PASS", "detail": "", "seconds": 0.1}]}))
            time.sleep(120)
        data = json.loads(table.read_text())
        data["rows"] += [{"check": "hangs", "status": "TIMEOUT", "detail": "killed", "seconds": 1},
                         {"check": "b", "status": "PASS", "detail": "", "seconds": 0.1}]
        data["running"] = None
        table.write_text(json.dumps(data))
        sys.exit(1)
    """))
    monkeypatch.setattr(gpu_all, "MIN_CONTINUATION_S", 0.5)
    step = gpu_all.Step("vllm", [sys.executable, str(script), str(tmp_path / "vllm_check"), "--time-limit", "1"], 2.0)
    outcome, = gpu_all.run_all([step], tmp_path, budget_s=60, log=quiet)
    assert outcome.status == "FAIL" and 2.0 <= outcome.seconds < 30, outcome
    assert outcome.failures == ["hangs: killed"]
    commands = [ln for ln in (tmp_path / "vllm.log").read_text().splitlines() if ln.startswith("$ ")]
    assert len(commands) == 2 and commands[1].endswith("--continue") and "--continue" not in commands[0]
