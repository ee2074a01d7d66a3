"""benchmarks/bench_gpu_step.py (the Megatron and FSDP engines' bf16 train step vs transformers on
one GPU): its CPU rehearsal end to end through the command line, so that the first GPU run does not
find a bug in the script, also with megatron hidden (the FSDP column alone); the parameter count
and FLOP formula its MFU rests on; the board -> peak lookup; the goal verdicts; the time budget.
The real shape runs in the `gpu` test where there is a GPU."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu_step as bench  # noqa: E402
import gpu_step_report  # noqa: E402
import gpu_step_sides  # noqa: E402


def _run_script(out: Path, *args, timeout=300, **env):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_step.py"), "--out",
                           str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def _check_result(r, out: Path, sides=("engine", "fsdp", "transformers")) -> dict:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "bench_gpu_step.json").read_text())
    assert res["ok"] is True and res["sides"] == list(sides)
    for side in sides:
        s = res[side]
        for part in ("train", "forward"):
            assert s[part]["iters"] >= 1
            for key in ("median_s", "tok_s", "tflops"):
                assert math.isfinite(s[part][key]) and s[part][key] > 0, (side, part, key, s[part])
        assert math.isfinite(s["first_loss"])
        k = s["kernels"]
        assert {"attention", "norm", "swiglu", "optimizer"} <= set(k)
        assert k["profiled_ops"]["attention"], f"{side}: no attention op seen by the profiler"
        assert any("adam" in op.lower() for op in k["profiled_ops"]["optimizer"])
    engines = [s for s in sides if s != "transformers"]
    assert set(res["ratios"]) == set(engines)
    for side in engines:
        for part in ("train", "forward"):
            assert res["ratios"][side][part] == pytest.approx(
                res[side][part]["tok_s"] / res["transformers"][part]["tok_s"])
    assert set(res["goals"]) == {"ratio", "mfu", "fsdp_ratio", "fsdp_mfu"}
    assert res["model"]["params"] == bench.param_counts(bench.Shape(**{
        k: res["model"][k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq",
                                     "seqs", "prompt")}))["total"]
    for line in ("train step tokens/s", "log-prob pass tokens/s", "goal: ",
                 *(f"kernels, {gpu_step_report.TITLES[s]}" for s in sides)):
        assert line in r.stdout
    return res


ALL_SIDES = ("engine", "fsdp", "fsdp_whole", "fsdp_foreach", "transformers")  # fsdp_noliger: no GPU


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One CPU rehearsal of every side, the default three and the fsdp variant columns (one start-up
    of the script for the two tests that read it); its output folder and the finished process."""
    out = tmp_path_factory.mktemp("rehearsal")
    r = _run_script(out, "--cpu-rehearsal", "--sides", "engine,fsdp,fsdp_whole,fsdp_foreach,fsdp_noliger,transformers")
    return out, r


def test_cpu_rehearsal_runs_both_sides_end_to_end(rehearsal):
    out, r = rehearsal
    res = _check_result(r, out, sides=ALL_SIDES)
    assert res["mode"] == "cpu-rehearsal" and res["dtype"] == "float32" and res["autocast"] is None
    # same weights and batch, fp32: the three implementations' first losses agree
    assert res["first_loss_abs_diff"]["engine"] < 1e-4 and res["first_loss_abs_diff"]["fsdp"] < 1e-4, res
    assert res["engine"]["train"]["mfu"] is None and res["peak_bf16_tflops"] is None
    assert all(g["met"] is None for g in res["goals"].values())
    assert "torch.optim.adamw.AdamW (fused=True)" in res["transformers"]["kernels"]["optimizer"]
    assert "float32 compute" in res["fsdp"]["kernels"]["precision"] and "mesh (1,)" in res["fsdp"]["kernels"]["sharding"]
    assert res["fsdp"]["kernels"]["output layer"].startswith("chunks of") and "(fused)" in res["fsdp"]["kernels"]["optimizer"]
    assert not list(out.glob("model-*")), "the temporary model folder was left behind"


def test_cpu_rehearsal_without_megatron_runs_the_fsdp_column(tmp_path):
    """A GPU image without megatron-core: the Megatron column is reported as not run (why), the
    FSDP engine and transformers run, the goals (the Megatron engine's) are not evaluated."""
    hidden = tmp_path / "hidden" / "megatron"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('megatron is hidden for this test')\n")
    r = _run_script(tmp_path, "--cpu-rehearsal", PYTHONPATH=f"{hidden.parent}{os.pathsep}{ROOT}")
    res = _check_result(r, tmp_path, sides=("fsdp", "transformers"))
    assert res["engine"] is None and "megatron is hidden" in res["not_run"]["engine"]
    assert "not run: megatron: megatron-core does not import" in r.stdout
    assert res["versions"]["megatron-core"]  # installed, only hidden: the version is still read
    assert res["first_loss_abs_diff"]["fsdp"] < 1e-4


def test_cpu_rehearsal_runs_the_fsdp_variant_columns(rehearsal):
    """The columns that tell the fsdp column's parts apart (its own, chunked with fused AdamW, is
    checked by the first rehearsal): whole logits without Liger, foreach AdamW; the no-Liger
    column is not run where Liger is off anyway (a CPU)."""
    out, r = rehearsal
    res = _check_result(r, out, sides=ALL_SIDES)
    assert "no CUDA GPU" in res["not_run"]["fsdp_noliger"]
    assert res["fsdp_whole"]["kernels"]["output layer"] == "the whole logits"
    assert res["fsdp_foreach"]["kernels"]["output layer"].startswith("chunks of")
    assert "(fused)" in res["fsdp_whole"]["kernels"]["optimizer"]
    assert "(fused)" not in res["fsdp_foreach"]["kernels"]["optimizer"]
    for side in ("fsdp_whole", "fsdp_foreach"):  # one change each: the same first loss
        assert res["first_loss_abs_diff"][side] < 1e-4


def test_a_gpu_run_without_gpu_fails_with_a_clear_message(tmp_path):
    r = _run_script(tmp_path, "--time-limit", "60", CUDA_VISIBLE_DEVICES="")  # no GPU, wherever it runs
    assert r.returncode == 1
    assert "--cpu-rehearsal" in r.stderr
    res = json.loads((tmp_path / "bench_gpu_step.json").read_text())
    assert res["ok"] is False and "no CUDA device" in res["error"]


@pytest.mark.gpu
def test_real_shape_on_the_gpu(tmp_path):
    r = _run_script(tmp_path, "--time-limit", "240", "--iters", "3", timeout=400)
    res = _check_result(r, tmp_path)
    assert res["mode"] == "gpu" and res["dtype"] == "bfloat16"
    assert 0.8e9 < res["model"]["params"] < 1.2e9
    for side in res["sides"]:
        assert res[side]["train"]["peak_bytes"] > 0
    for diff in res["first_loss_abs_diff"].values():
        assert diff < 0.1, res  # bf16 vs fp32 master weights under autocast


def test_parameter_count_is_the_hf_models():
    import torch
    from transformers import AutoModelForCausalLM

    from verl_hpc.models.tiny import hf_config

    s = bench.GPU_SHAPE
    config = hf_config("llama", layers=s.layers, vocab_size=s.vocab, hidden=s.hidden, heads=s.heads,
                       kv_heads=s.kv_heads, head_dim=s.head_dim, ffn=s.ffn, max_positions=s.seq)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts = bench.param_counts(s)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["matmul"] == s.vocab * s.hidden  # the input embedding table
    assert 0.8e9 < counts["total"] < 1.2e9 and s.seq == 2048


def test_flop_formula_by_hand():
    s = bench.Shape(hidden=8, layers=2, heads=2, kv_heads=1, ffn=16, vocab=10, seq=4, seqs=3, prompt=1)
    n = 1000
    tokens = 12
    assert bench.model_flops(s, n) == {"train": 6 * n * tokens + 12 * 2 * 8 * 4 * tokens,
                                       "forward": 2 * n * tokens + 4 * 2 * 8 * 4 * tokens}


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3 (sm 9.0), CUDA 12.8", "h100-80gb"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA H200 NVL", None),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
    ("NVIDIA GeForce RTX 4090", None),
    ("no GPU", None),
])
def test_board_names_map_to_the_peak_table(name, key):
    from verl_hpc.config.gpus import GPUS

    peak, found = bench.peak_of(name)
    assert found == key
    assert peak == (GPUS[key].bf16_tflops if key else None)


def test_peaks_the_goals_rest_on():
    assert bench.peak_of("NVIDIA H100 80GB HBM3")[0] == 989.0
    assert bench.peak_of("NVIDIA H100 PCIe")[0] == 756.0
    assert bench.peak_of("NVIDIA H200")[0] == 989.0
    assert bench.peak_of("NVIDIA A100-SXM4-80GB")[0] == 312.0


def _result(ratio, mfu):
    return {"ratios": {"engine": {"train": ratio}}, "engine": {"train": {"mfu": mfu}}, "not_run": {}}


def test_goal_verdicts():
    g = gpu_step_report.goals(_result(1.4, 0.45), rehearsal=False, gpu_key="h100-80gb")
    assert g["ratio"]["met"] is True and g["mfu"]["met"] is True and not g["ratio"]["note"]
    g = gpu_step_report.goals(_result(1.2, 0.35), rehearsal=False, gpu_key="h100-pcie")
    assert g["ratio"]["met"] is False and g["mfu"]["met"] is False
    g = gpu_step_report.goals(_result(1.5, None), rehearsal=False, gpu_key=None)
    assert g["mfu"]["met"] is None and "no dense bf16 peak" in g["mfu"]["note"]
    assert "not one" in g["ratio"]["note"]
    g = gpu_step_report.goals(_result(0.5, None), rehearsal=True, gpu_key=None)
    assert g["ratio"]["met"] is None and "rehearsal" in g["ratio"]["note"]
    without = {"ratios": {"fsdp": {"train": 1.1}}, "engine": None, "fsdp": {"train": {"mfu": 0.36}},
               "not_run": {"engine": "no megatron"}}
    g = gpu_step_report.goals(without, rehearsal=False, gpu_key="h100-80gb")
    assert g["ratio"]["met"] is None and "did not run: no megatron" in g["ratio"]["note"]
    assert g["fsdp_ratio"]["met"] is True and g["fsdp_mfu"]["met"] is True  # >= 1.0x, >= 35%
    slow = dict(without, ratios={"fsdp": {"train": 0.94}}, fsdp={"train": {"mfu": 0.301}})
    g = gpu_step_report.goals(slow, rehearsal=False, gpu_key="h100-80gb")  # the first GPU run's figures
    assert g["fsdp_ratio"]["met"] is False and g["fsdp_mfu"]["met"] is False


def test_timed_loop_keeps_to_its_budget():
    calls = []
    assert len(bench.timed_loop(lambda: calls.append(1), max_iters=10, budget_s=0.0, min_iters=3)) == 3
    assert len(bench.timed_loop(lambda: None, max_iters=10, budget_s=60.0, min_iters=1)) == 10


def test_compile_failure_is_reported_not_raised(monkeypatch):
    import torch

    def broken(fn, **kwargs):
        def run(*a):
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    why = gpu_step_sides.compile_problem("cpu")
    assert why.startswith("RuntimeError: Failed to find C compiler")
