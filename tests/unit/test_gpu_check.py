"""The first-GPU kit (python -m verl_hpc.gpu_check) on a machine without a GPU: the dry run lists
every check and exits 0, a real run refuses (it must never pass without testing), the wheel
folder's selection rules, the pluggable memory plan. (The CPU rehearsal of the checks themselves:
tests/dist/test_gpu_check_rehearsal.py.)"""
import subprocess
import sys
from pathlib import Path

import pytest

from verl_hpc.gpu_check import wheels
from verl_hpc.gpu_check.__main__ import load_memory_plan, main
from verl_hpc.gpu_check.checks import CHECKS

ROOT = Path(__file__).resolve().parents[2]
NOT_ONE_GPU = {"vllm_gpu", "te_fp8", "tp_gt_1", "multinode_nccl"}


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "verl_hpc.gpu_check", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.unit
def test_dry_run_lists_every_check_and_exits_0():
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr
    for c in CHECKS:
        assert c.name in r.stdout and c.what in r.stdout
    assert NOT_ONE_GPU <= {c.name for c in CHECKS}
    assert {"nccl_bootstrap", "cuda_rng_checkpoint", "engine_bf16_logprobs", "train_step",
            "save_resume", "fused_adam_resume", "memory_plan"} <= {c.name for c in CHECKS}


@pytest.mark.unit
def test_a_real_run_without_gpu_refuses(capsys):
    assert main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


@pytest.mark.unit
def test_wheel_selection():
    assert not wheels.carried("torch") and not wheels.carried("nvidia-nccl-cu13")
    assert not wheels.carried("typing_extensions") and not wheels.carried("Jinja2")
    assert wheels.carried("megatron-core") and wheels.carried("numpy") and wheels.carried("h5py")
    from verl_hpc.parallel.cpu_compat import VERIFIED_MEGATRON_VERSION

    assert f"megatron-core=={VERIFIED_MEGATRON_VERSION}" in wheels.requirements()
    args = wheels.target_args("3.11", "2.28")
    platforms = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert "manylinux_2_28_x86_64" in platforms and "manylinux_2_17_x86_64" in platforms
    assert "manylinux_2_29_x86_64" not in platforms and "manylinux2014_x86_64" in platforms


@pytest.mark.unit
def test_memory_plan_is_pluggable(monkeypatch):
    import types

    mod = types.ModuleType("fake_plan")
    mod.budget = lambda component, facts: 123
    monkeypatch.setitem(sys.modules, "fake_plan", mod)
    assert load_memory_plan("fake_plan:budget")("train step", {}) == 123
    with pytest.raises(SystemExit, match="MODULE:FUNCTION"):
        load_memory_plan("fake_plan")
    planning = types.ModuleType("verl_hpc.planning")  # a planning package without the hook
    monkeypatch.setitem(sys.modules, "verl_hpc.planning", planning)
    assert load_memory_plan(None) is None
    planning.gpu_check_budget = mod.budget
    assert load_memory_plan(None) is mod.budget
