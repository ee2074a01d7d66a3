"""`make gpu-all`'s speed goals (verl_hpc/gpu_check/all.py): the summary prints the benchmarks'
goal lines (PASS / FAIL / NOT EVALUATED with the figure), says why a benchmark's figures are missing,
and `--steps` runs a subset (the speed steps alone) with the others SKIPPED."""
import json

import pytest

from verl_hpc.gpu_check import all as gpu_all

pytestmark = pytest.mark.unit


def _outcome(tmp_path, name, status="PASS"):
    return gpu_all.Outcome(gpu_all.Step(name, ["x"], 10), status, 1.0, tmp_path / f"{name}.log")


def test_the_summary_prints_the_goal_lines_of_both_benchmarks(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench_gpu_step.json").write_text(json.dumps({"ok": True, "goal_lines": [
        "goal: megatron train >= 1.2x transformers: 1.31x PASS",
        "goal: fsdp train >= 1.15x transformers + Liger: 1.02x FAIL"]}))
    outcomes = [_outcome(tmp_path, "bench"), _outcome(tmp_path, "logits", "TIMEOUT")]
    text = gpu_all.write_summary(outcomes, tmp_path, ["header"])
    assert "speed goals (issue 75): 1 pass, 1 fail, 1 not evaluated" in text
    assert "goal: megatron train >= 1.2x transformers: 1.31x PASS" in text
    assert "goal: (logits) NOT EVALUATED: logits/bench_gpu_logits.json was not written" in text
    data = json.loads((tmp_path / "summary.json").read_text())
    assert len(data["goals"]) == 3 and data["goals"][1].endswith("FAIL")


def test_a_failed_benchmark_says_why_its_goals_are_missing(tmp_path):
    (tmp_path / "logits").mkdir()
    (tmp_path / "logits" / "bench_gpu_logits.json").write_text(json.dumps({"ok": False, "error": "RuntimeError: boom"}))
    lines = gpu_all.goal_lines(tmp_path)
    assert lines[1] == "goal: (logits) NOT EVALUATED: the benchmark failed: RuntimeError: boom"
    # no benchmark step ran (all skipped): no goal section at all
    text = gpu_all.summary([_outcome(tmp_path, "gpu_check")], [], [])
    assert "speed goals" not in text


def test_steps_runs_a_subset_and_skips_the_rest(tmp_path):
    only = gpu_all.parse_steps("install,bench,logits")
    steps = gpu_all.plan(tmp_path, py="PY", wheels=tmp_path / "w", rehearsal=False, missing=lambda: [], only=only)
    run = [s.name for s in steps if s.command is not None]
    assert run == ["install", "bench", "logits"]
    assert all(s.why == "not asked for (--steps)" for s in steps if s.command is None)
    assert sum(s.limit_s for s in steps if s.command is not None) <= 255  # the speed figures alone: 4.25 min
    for bad in ("bench,nope", "", " , "):
        with pytest.raises(ValueError, match="a comma list of install, vllm_install, gpu_check"):
            gpu_all.parse_steps(bad)
    assert gpu_all.parse_steps(None) is None


def test_dry_run_with_steps(capsys):
    assert gpu_all.main(["--dry-run", "--steps", "bench"]) == 0
    out = capsys.readouterr().out
    assert "gpu_check" in out and "skipped: not asked for (--steps)" in out and "bench_gpu_step.py" in out
    with pytest.raises(SystemExit):
        gpu_all.main(["--dry-run", "--steps", "everything"])
