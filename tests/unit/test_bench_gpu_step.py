"""benchmarks/bench_gpu_step.py (the Megatron and FSDP engines' bf16 train step vs transformers and
transformers + Liger on one GPU) and benchmarks/bench_gpu_logits.py (the output layer alone at a
Qwen vocabulary): their CPU rehearsals end to end through the command line, every column included
(the Liger peer through a stand-in liger_kernel package, tests/stand_ins/liger: Liger's kernels
are Triton), so that the first GPU run does not find a bug in the scripts, also with megatron
hidden (the FSDP columns alone); the kernels column of a model Liger patched (no act_fn); the
parameter count and FLOP formula MFU rests on; the board -> peak lookup; the goal verdicts; the
time budget. The real shape runs in the `gpu` test where there is a GPU."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIGER_STAND_IN = ROOT / "tests" / "stand_ins" / "liger"
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu_step as bench  # noqa: E402
import gpu_step_report  # noqa: E402
import gpu_step_sides  # noqa: E402


def _run_script(out: Path, *args, timeout=300, script="bench_gpu_step.py", **env):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--out",
                           str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def _check_result(r, out: Path, sides=("engine", "fsdp", "transformers")) -> dict:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "bench_gpu_step.json").read_text())
    assert res["ok"] is True and res["partial"] is False  # the JSON is rewritten after each side, then final
    assert res["sides"] == sorted(sides, key=bench.RUN_ORDER.index)
    for side in sides:
        s = res[side]
        for part in ("train", "forward"):
            assert s[part]["iters"] >= 1
            for key in ("median_s", "tok_s", "tflops"):
                assert math.isfinite(s[part][key]) and s[part][key] > 0, (side, part, key, s[part])
        assert math.isfinite(s["first_loss"])
        k = s["kernels"]
        assert {"attention", "norm", "swiglu", "optimizer", "output layer"} <= set(k)
        assert k["profiled_ops"]["attention"], f"{side}: no attention op seen by the profiler"
        assert any("adam" in op.lower() for op in k["profiled_ops"]["optimizer"])
    engines = [s for s in sides if s not in bench.BASELINES]
    assert set(res["ratios"]) == set(engines)
    assert set(res["ratios_liger"]) == (set(engines) if "transformers_liger" in sides else set())
    for side in engines:
        for part in ("train", "forward"):
            assert res["ratios"][side][part] == pytest.approx(
                res[side][part]["tok_s"] / res["transformers"][part]["tok_s"])
            if "transformers_liger" in sides:
                assert res["ratios_liger"][side][part] == pytest.approx(
                    res[side][part]["tok_s"] / res["transformers_liger"][part]["tok_s"])
    assert set(res["goals"]) == {row[0] for row in gpu_step_report.goal_rows()}
    assert res["goal_lines"] == gpu_step_report.goal_lines(res) and len(res["goal_lines"]) == 10
    _check_diagnostics(res, sides)
    assert "diagnostics, " in r.stdout and "attention per (query, key) pair" in r.stdout
    assert res["failed"] == {}
    assert res["model"]["params"] == bench.param_counts(bench.Shape(**{
        k: res["model"][k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq",
                                     "seqs", "prompt")}))["total"]
    for line in ("train step tokens/s", "log-prob pass tokens/s", "goal: ",
                 *(f"kernels, {gpu_step_report.TITLES[s]}" for s in sides)):
        assert line in r.stdout
    return res


def _check_diagnostics(res, sides):
    """Every side's diagnostics columns (gpu_step_diag.py; issue 85): the kernel profile with its
    optimizer phase, the host syncs by kind, what the output layer read at steps 1-3 (the engines:
    the device rule on the pretended free memory, Adam's moments still to come at step 1 only);
    and the attention pair weights once."""
    from verl_hpc.runtime.host_syncs import KINDS

    rehearsal = res["mode"] == "cpu-rehearsal"
    for side in sides:
        d = res[side]["diagnostics"]
        k = d["kernel_profile"]
        assert k["kernels"] > 0 and k["busy_ms"] > 0 and k["top"] and k["optimizer_phase"]["ms"] >= 0, (side, k)
        assert set(d["host_syncs"]["recorded"]) == set(KINDS)
        assert (d["host_syncs"]["cuda_sync_debug"] is None) is rehearsal  # torch's own count: a GPU's
        reads = d["output_layer_steps_1_to_3"]
        assert len(reads) == 3
        if side in bench.BASELINES:
            assert all(x["path"] is None for x in reads)
        elif side not in ("engine_whole", "fsdp_whole", "engine_chunked", "fsdp_chunked") and rehearsal:
            assert [x["path"] for x in reads] == ["whole"] * 3, (side, reads)
            assert [x["free_bytes"] for x in reads] == [float(bench.REHEARSAL_FREE_BYTES)] * 3
            assert reads[0]["pending_bytes"] > 0 and reads[1]["pending_bytes"] == reads[2]["pending_bytes"] == 0
        elif side == "engine":  # a GPU: the device rule read the device's memory (FSDP's log-probs: Liger)
            assert all(x["free_bytes"] > 0 for x in reads) and reads[2]["pending_bytes"] == 0, (side, reads)
    a = res["attention_costs"]
    assert a["pair_weight_causal"] > 0 and a["pair_weight_dense_mask"] > 0 and a["pair_weight_cost_model"] > 0


def test_a_side_that_raises_is_closed_and_leaves_no_patch(tmp_path):
    """A side whose step fails (an out-of-memory, a kernel) is closed before the error goes on, so
    its patches (Liger's, on transformers' modeling modules) do not stay on for the sides after it."""
    closed = []

    class Failing:
        def __init__(self, *args):
            pass

        def train(self, batch):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def close(self):
            closed.append(True)

    plan = {"dtype": "float32", "device": "cpu", "warmup": 1, "iters": 1, "min_iters": 1}
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bench.run_side(Failing, tmp_path, bench.REHEARSAL_SHAPE, {}, plan, 1.0)
    assert closed == [True]


# every side but fsdp_noliger (Liger is off on a CPU: that column is the fsdp column there)
ALL_SIDES = tuple(s for s in bench.SIDES if s != "fsdp_noliger")


# The GPU benchmark's CPU rehearsals (the script end to end, every column built and stepped) are in
# make test-long, as the GPU kit's are: make test keeps the script's parts that need no engine
# (its side closing, time limit, FLOP and goal arithmetic, Liger report) below
@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One CPU rehearsal of every side (one start-up of the script for the tests that read it), the
    Liger peer through the stand-in package; its output folder and the finished process."""
    out = tmp_path_factory.mktemp("rehearsal")
    r = _run_script(out, "--cpu-rehearsal", "--sides", ",".join(bench.SIDES),
                    PYTHONPATH=f"{LIGER_STAND_IN}{os.pathsep}{ROOT}")
    return out, r


@pytest.mark.long  # the script end to end (above)
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
    # the device rule on the rehearsal's pretended 64 MiB: the tiny shape's whole logits fit
    assert res["fsdp"]["kernels"]["output layer"] == (
        "the whole logits (last micro-batch; rule: auto, the device's free memory)")
    assert "(fused)" in res["fsdp"]["kernels"]["optimizer"]
    assert not list(out.glob("model-*")), "the temporary model folder was left behind"


@pytest.mark.long  # the script end to end (above)
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


@pytest.mark.long  # the script end to end (above)
def test_cpu_rehearsal_runs_the_fsdp_variant_columns(rehearsal):
    """The columns that tell the engines' parts apart (the fsdp and megatron columns are checked by
    the first rehearsal): whole logits, the CPU's chunk budget (its chunks run: a quarter of the
    tokens at the rehearsal's vocabulary), per-block compile, foreach AdamW; the peer
    transformers + Liger (the stand-in's fused SwiGLU, no act_fn on its MLP); the no-Liger column
    is not run where Liger is off anyway (a CPU). One change each: the same first loss."""
    out, r = rehearsal
    res = _check_result(r, out, sides=ALL_SIDES)
    assert "no CUDA GPU" in res["not_run"]["fsdp_noliger"]
    k = {s: res[s]["kernels"] for s in ALL_SIDES}
    for side in ("fsdp_whole", "engine_whole"):
        assert k[side]["output layer"] == "the whole logits (model.logits_chunk_tokens = 0)"
    chunk = gpu_step_sides.cpu_budget_chunk(bench.REHEARSAL_SHAPE)
    assert chunk < bench.REHEARSAL_SHAPE.seqs * (bench.REHEARSAL_SHAPE.seq - bench.REHEARSAL_SHAPE.prompt)
    for side in ("fsdp_chunked", "engine_chunked"):
        assert k[side]["output layer"].startswith(f"chunks of {chunk} tokens"), k[side]
    assert "compile=True" in k["fsdp_compile"]["sharding"] and k["fsdp_compile"]["profiled_ops"]["compiled"]
    assert "compile=False" in k["fsdp"]["sharding"] and not k["fsdp"]["profiled_ops"]["compiled"]
    assert "(fused)" in k["fsdp_whole"]["optimizer"] and "(fused)" not in k["fsdp_foreach"]["optimizer"]
    assert "reshard_after_forward=False" in k["fsdp_keep"]["sharding"]
    assert "reshard_after_forward=True" in k["fsdp"]["sharding"]
    assert "graphs from" in k["fsdp_compile"]["compile"]
    # the per-parameter norm and clip in fsdp_loopclip's optimizer phase, the foreach ones in fsdp's
    clip = {s: k[s]["profiled_ops"]["grad_norm_clip"] for s in ("fsdp", "fsdp_loopclip")}
    assert "aten::_foreach_norm" in clip["fsdp"] and "aten::_foreach_mul_" in clip["fsdp"], clip
    assert "aten::_foreach_norm" not in clip["fsdp_loopclip"] and "aten::linalg_vector_norm" in clip["fsdp_loopclip"]
    assert k["transformers_liger"]["swiglu"] == "Liger's fused SwiGLU (LigerSwiGLUMLP)"
    assert "LigerRMSNorm" in k["transformers_liger"]["norm"]
    assert k["transformers_liger"]["output layer"].startswith("Liger's fused linear cross-entropy")
    assert k["transformers"]["swiglu"].startswith("unfused (")  # the stand-in's class swap did not leak
    assert "weight float32 (torch's fused rms_norm)" in k["engine"]["norm"]
    for side in ALL_SIDES:
        if side != "transformers":
            assert res["first_loss_abs_diff"][side] < 1e-4, side


@pytest.mark.heavy
def test_a_short_time_limit_drops_sides_not_the_peer(tmp_path):
    """The peers run first; a side that would not end within --time-limit (1.2 x the slowest side
    so far) is reported as not run, and the figures of the others are still written."""
    assert sorted(bench.RUN_ORDER) == sorted(bench.SIDES) and bench.RUN_ORDER[:2] == bench.BASELINES
    r = _run_script(tmp_path, "--cpu-rehearsal", "--time-limit", "1", "--sides", "engine,fsdp,transformers")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_gpu_step.json").read_text())
    assert res["sides"] == ["transformers"] and res["ratios"] == {}
    assert res["not_run"] == {"engine": "out of time (--time-limit 1 s)", "fsdp": "out of time (--time-limit 1 s)"}
    assert "goal: fsdp train >= 1.15x transformers: - NOT EVALUATED" in r.stdout


@pytest.mark.heavy
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


def _result(train=None, forward=None, mfu=None, sides=("engine", "fsdp", "transformers", "transformers_liger"),
            not_run=None):
    """A result with each side's tokens/s: transformers 100 / 100, transformers + Liger 110 / 120,
    the engines at train x 100 and forward x 100 (the ratios to transformers)."""
    train = train or {"engine": 1.35, "fsdp": 1.3}
    forward = forward or {"engine": 1.4, "fsdp": 1.35}
    mfu = mfu or {"engine": 0.40, "fsdp": 0.39}
    r = {"sides": list(sides), "not_run": not_run or {}, "failed": {},
         "transformers": {"train": {"tok_s": 100.0}, "forward": {"tok_s": 100.0}},
         "transformers_liger": {"train": {"tok_s": 110.0}, "forward": {"tok_s": 120.0}}}
    for e in ("engine", "fsdp"):
        r[e] = {"train": {"tok_s": 100.0 * train[e], "mfu": mfu[e]}, "forward": {"tok_s": 100.0 * forward[e]}}
    return r


def test_goal_verdicts():
    g = gpu_step_report.goals(_result(), rehearsal=False, gpu_key="h100-80gb")
    assert all(v["met"] is True for v in g.values()), g  # e.g. fsdp 1.3 / 1.1 = 1.18 >= 1.15
    assert g["engine_train_vs_transformers_liger"]["value"] == pytest.approx(1.35 / 1.1)
    assert g["fsdp_forward_vs_transformers_liger"]["value"] == pytest.approx(1.35 / 1.2)
    # 1.2x transformers is 1.09x transformers + Liger: the FSDP goal met against one, not the other
    g = gpu_step_report.goals(_result(train={"engine": 1.25, "fsdp": 1.2}), rehearsal=False, gpu_key="h200")
    assert g["fsdp_train_vs_transformers"]["met"] is True and g["fsdp_train_vs_transformers_liger"]["met"] is False
    assert g["engine_train_vs_transformers"]["met"] is True and g["engine_train_vs_transformers_liger"]["met"] is False
    # the figures: 0.87x, 31.2% MFU, log-prob pass 1.03x
    g = gpu_step_report.goals(_result(train={"engine": 0.87, "fsdp": 0.94}, forward={"engine": 1.03, "fsdp": 0.98},
                                      mfu={"engine": 0.312, "fsdp": 0.339}), rehearsal=False, gpu_key="h200")
    assert not any(v["met"] for v in g.values())
    g = gpu_step_report.goals(_result(mfu={"engine": None, "fsdp": None}), rehearsal=False, gpu_key=None)
    assert g["engine_mfu"]["met"] is None and "no dense bf16 peak" in g["engine_mfu"]["note"]
    assert "neither" in g["engine_train_vs_transformers"]["note"]
    g = gpu_step_report.goals(_result(), rehearsal=True, gpu_key=None)
    assert all(v["met"] is None and "rehearsal" in v["note"] for v in g.values())
    no_liger = _result(sides=("engine", "fsdp", "transformers"), not_run={"transformers_liger": "no liger"})
    g = gpu_step_report.goals(no_liger, rehearsal=False, gpu_key="h100-80gb")
    assert g["fsdp_train_vs_transformers_liger"]["met"] is None
    assert "transformers + Liger did not run: no liger" in g["fsdp_train_vs_transformers_liger"]["note"]
    assert g["fsdp_train_vs_transformers"]["met"] is True
    no_megatron = _result(train={"engine": 1.0, "fsdp": 1.2}, sides=("fsdp", "transformers", "transformers_liger"),
                          not_run={"engine": "no megatron"})
    g = gpu_step_report.goals(no_megatron, rehearsal=False, gpu_key="h100-80gb")
    assert g["engine_train_vs_transformers"]["met"] is None and "did not run: no megatron" in g["engine_mfu"]["note"]
    lines = gpu_step_report.goal_lines({**no_megatron, "goals": g})
    assert lines[0].startswith("goal: megatron train >= 1.2x transformers: - NOT EVALUATED (megatron did not run")
    assert "goal: fsdp train >= 1.15x transformers + Liger: 1.09x FAIL" in lines


def test_a_model_liger_patched_reports_its_mlp_without_act_fn(tmp_path, monkeypatch):
    """Liger's per-instance patch binds LigerSwiGLUMLP's forward on each MLP (and its class, in
    liger-kernel 0.8, has no act_fn): the kernels column names it, where it read act_fn and
    crashed; a transformers model built after the patch keeps transformers' own classes
    (engines/fsdp/liger.py apply_liger puts the modeling module back)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from verl_hpc.engines.fsdp.liger import apply_liger
    from verl_hpc.models.tiny import hf_config

    monkeypatch.syspath_prepend(str(LIGER_STAND_IN))
    for name in [m for m in sys.modules if m.startswith("liger_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    import liger_kernel.transformers as stand_in

    config = hf_config("llama", layers=1, vocab_size=64, hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=32,
                       max_positions=32)
    mlp_cls, norm_cls = modeling_llama.LlamaMLP, modeling_llama.LlamaRMSNorm
    model = AutoModelForCausalLM.from_config(config)
    apply_liger(model)
    mlp = model.model.layers[0].mlp
    assert not hasattr(mlp, "act_fn")
    assert gpu_step_sides.swiglu_kind(mlp) == "Liger's fused SwiGLU (LigerSwiGLUMLP)"
    assert gpu_step_sides.swiglu_kind(stand_in.LigerSwiGLUMLP(config)).startswith("Liger's fused SwiGLU")
    assert modeling_llama.LlamaMLP is mlp_cls and modeling_llama.LlamaRMSNorm is norm_cls
    later = AutoModelForCausalLM.from_config(config).model.layers[0].mlp
    assert gpu_step_sides.swiglu_kind(later) == "unfused (transformers.activations.SiLUActivation then a product)"


@pytest.mark.heavy
def test_logits_probe_rehearsal(tmp_path):
    """bench_gpu_logits.py on CPU: both lengths, every path, the chunked path equal to the whole
    logits, the goal lines (not evaluated on CPU)."""
    r = _run_script(tmp_path, "--cpu-rehearsal", script="bench_gpu_logits.py", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_gpu_logits.json").read_text())
    short, long = res["cases"]
    assert [c["tokens"] for c in res["cases"]] == [2 * 128, 8 * 128]
    assert [x["path"] for x in short["results"]] == ["whole", "chunked", "cpu_budget", "auto", "chunked_fp32gemm",
                                                     "chunked_fused"]
    # both GEMM forms of the weight gradient at both lengths; the log-probs-only update at the long one
    assert [x["path"] for x in long["results"]] == ["auto", "auto_fp32gemm", "auto_logprobs", "auto_fused"]
    assert long["auto_chunk"] > 0 and long["auto_logprobs_chunk"] >= 0
    assert all(x["median_s"] > 0 for c in res["cases"] for x in c["results"])
    assert max(short["max_abs_diff"].values()) < 1e-5
    assert len(res["goal_lines"]) == 2 and all("NOT EVALUATED (CPU rehearsal" in g for g in res["goal_lines"])
    assert "chunked update <= 1.1x the whole logits'" in res["goal_lines"][0]


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


def test_logits_probe_goal_verdicts():
    """bench_gpu_logits' goals from made-up results: within / past 1.1x, an out-of-memory at the
    long case (FAIL), a run stopped before the long case (not evaluated, never a pass)."""
    import bench_gpu_logits as probe

    def case(rows, *results):
        return {"rows": rows, "tokens": rows * 4096, "results": list(results)}

    short = case(2, {"path": "whole", "median_s": 1.0}, {"path": "chunked", "median_s": 1.08})
    long = case(8, {"path": "auto", "median_s": 3.0})
    g = probe.goals([short, long], rehearsal=False)
    assert g["chunked_over_whole"]["met"] is True and g["long_no_oom"]["met"] is True
    slow = case(2, {"path": "whole", "median_s": 1.0}, {"path": "chunked", "median_s": 1.45})  # the H200's
    oom = case(8, {"path": "auto", "oom": "CUDA out of memory"})
    g = probe.goals([slow, oom], rehearsal=False)
    assert g["chunked_over_whole"]["met"] is False and g["long_no_oom"]["met"] is False
    r = {"vocab": 151936, "cases": [short]}
    r["goals"] = probe.goals(r["cases"], rehearsal=False)
    lines = probe.goal_lines(r)
    assert lines[0].endswith("1.08x PASS") and "8 x 4,096: no out-of-memory: - NOT EVALUATED" in lines[1]
