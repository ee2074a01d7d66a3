"""`python -m verl_hpc.plan`: the shipped flagship configs fit, switched-off memory features do not,
--suggest is quick, and the planner runs where torch is not installed."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_hpc.config import load_config
from verl_hpc.planning import MARGIN, plan_job

REPO = Path(__file__).resolve().parents[3]
OFF = ["parallel.recompute_granularity=none", "ref.param_offload=false"] + [
    f"{r}.{f}=false" for r in ("actor", "critic") for f in ("param_offload", "grad_offload", "optimizer_offload")]

# run the CLI with torch made unimportable: the planner must not need it (login nodes)
NO_TORCH = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['verl_hpc.plan'] + sys.argv[1:]; "
            "runpy.run_module('verl_hpc.plan', run_name='__main__')")


def run_plan(*args):
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def shipped_gpu_configs():
    """Every configs/*.yaml job that asks for GPUs, loaded, by file name (the CPU demos do not; the
    bases, base*.yaml, are not jobs: base_gpu_cluster.yaml asks for GPUs but names no model)."""
    loaded = {p.name: load_config(str(p), []) for p in sorted((REPO / "configs").glob("*.yaml"))
              if not p.name.startswith("base")}
    out = {name: cfg for name, cfg in loaded.items() if cfg.slurm.gpus_per_node > 0}
    assert {"grpo_8b.yaml", "ppo_70b.yaml"} <= out.keys()
    return out


@pytest.mark.heavy
def test_every_shipped_gpu_config_fits_with_headroom():
    """One test for all of them, not one per file: a parametrization would load the 29 configs while
    collecting, in each pytest-xdist worker (about 6 s of CPU each)."""
    for name, cfg in shipped_gpu_configs().items():
        plan = plan_job(cfg)
        where = f"{name}: peak {plan.peak / 2 ** 30:.1f} GiB, limit {plan.limit / 2 ** 30:.1f} GiB, {plan.peak_phase}"
        assert plan.device == "gpu" and plan.limit > 70e9, where
        assert plan.fits(margin=MARGIN), where
        # the start-up rule of vLLM: what the roles keep + its budget must fit the GPU
        assert plan.phase_total("startup") <= plan.limit, where


@pytest.mark.heavy
def test_plan_cli_fits_and_refuses_without_offload_and_recompute():
    ok = run_plan("configs/ppo_70b.yaml")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for needle in ("update_actor", "checkpoint", "weight_sync", "vllm", "nccl", "host memory per node",
                   "fits, headroom", "NCCL communicators per rank", "two-stage wake"):
        assert needle in ok.stdout, needle
    print(ok.stdout)
    bad = run_plan("configs/ppo_70b.yaml", *OFF)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    line = bad.stderr.strip().splitlines()[-1]
    assert "peak" in line and "exceeds" in line and "--suggest" in line and "largest component" in line, line


@pytest.mark.heavy
def test_suggest_answers_quickly_with_fitting_layouts():
    start = time.monotonic()
    r = run_plan("configs/ppo_70b.yaml", *OFF, "--suggest")
    took = time.monotonic() - start
    assert "layouts fit with >= 10% headroom" in r.stdout, r.stdout[-2000:]
    assert "training MFU" in r.stdout  # the step-time assumptions are printed
    assert took < 10 * 3, took  # < 10 s on a quiet machine; generous on a loaded one
    suggested = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("x1.00")][0]
    overrides = suggested.split("headroom")[1].split("%", 1)[1].split()
    again = run_plan("configs/ppo_70b.yaml", *OFF, *overrides)
    assert again.returncode == 0, again.stderr  # the suggested layout does fit


def test_unknown_gpu_type_is_refused_with_the_valid_names():
    r = run_plan("configs/ppo_70b.yaml", "slurm.gpu_type=h999")
    assert r.returncode == 2 and "slurm.gpu_type" in r.stderr and "h100-80gb" in r.stderr


def test_cpu_job_is_compared_with_node_ram(tmp_path):
    plan = plan_job(load_config(str(REPO / "configs/ppo_70b.yaml"),
                                ["slurm.gpus_per_node=0", "parallel.backend=gloo", "slurm.mem_gb=64"]))
    assert plan.device == "cpu" and plan.limit == 64e9 and not plan.fits()


def test_cpu_kv_cache_is_sized_for_the_rollout_batch():
    from verl_hpc.planning.model_shape import KNOWN
    from verl_hpc.planning.rollout import cpu_kv_bytes

    cfg = load_config(str(REPO / "configs/grpo_tiny_cpu.yaml"), ["trainer.val_every=0"])
    assert cfg.rollout.max_num_seqs(cfg) == cfg.data.train_batch_size * cfg.rollout.n == 32
    arch = KNOWN["llama-3.2-1b"]
    # 2 (K, V) x layers x kv heads x head_dim x 4 bytes per token, 32 sequences of 128 tokens and
    # vLLM's null block
    per_token = 2 * 16 * 8 * 64 * 4
    assert cpu_kv_bytes(arch, 96, 32) == per_token * (32 + 1) * 128
    assert cpu_kv_bytes(arch, 96, 256) == min(per_token * 257 * 128, 4 << 30)


def _config_json(folder, **fields):
    """A model folder with only config.json: all the planner reads."""
    folder.mkdir()
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 500, "hidden_size": 288, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 256}
    (folder / "config.json").write_text(json.dumps(dict(base, **fields)))
    return folder


@pytest.fixture
def tiny_job(tmp_path):
    """Overrides of a CPU GRPO job on a 2-layer model with 9 heads (3 KV heads), and a 4-expert MoE."""
    (tmp_path / "train.jsonl").touch()
    dense = _config_json(tmp_path / "dense")
    moe = _config_json(tmp_path / "moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=4,
                       num_experts_per_tok=2)
    job = ["rollout.engine=hf", "data.max_prompt_length=64", "data.max_response_length=64", "rollout.n=4",
           f"data.train_files=[{tmp_path / 'train.jsonl'}]", "data.train_batch_size=12",
           "actor.ppo_mini_batch_size=12", "actor.micro_batch_size=1"]
    return job, dense, moe


@pytest.mark.parametrize("model,layout,words", [
    ("dense", ["slurm.tasks_per_node=4", "parallel.pp=4"], "parallel.pp = 4 does not divide the model's "
                                                           "num_hidden_layers = 2"),
    ("dense", ["slurm.tasks_per_node=2", "parallel.tp=2"], "parallel.tp = 2 does not divide the model's "
                                                           "num_attention_heads = 9"),
    ("moe", ["slurm.tasks_per_node=3", "parallel.ep=3"], "parallel.ep = 3 does not divide the model's number of "
                                                         "experts = 4"),
    ("dense", ["slurm.tasks_per_node=2", "parallel.ep=2"], "parallel.ep = 2 needs a mixture-of-experts model"),
])
def test_plan_refuses_the_layouts_submit_refuses(tiny_job, capsys, model, layout, words):
    from verl_hpc.plan import main

    job, dense, moe = tiny_job
    folder = {"dense": dense, "moe": moe}[model]
    assert main([f"model.path={folder}", *job]) == 0  # the model itself plans
    capsys.readouterr()
    assert main([f"model.path={folder}", *job, *layout]) == 2
    out = capsys.readouterr()
    assert words in out.err and f"({folder / 'config.json'})" in out.err and "fits" not in out.out, out


@pytest.mark.parametrize("option", ["--gpu-memory-gb", "--node-memory-gb"])
@pytest.mark.parametrize("value", ["-5", "nan", "inf", "0"])
def test_plan_refuses_a_memory_size_that_is_no_positive_number(tiny_job, capsys, option, value):
    from verl_hpc.plan import main

    job, dense, _ = tiny_job
    gpu = ["slurm.gpus_per_node=2", "slurm.tasks_per_node=2", "slurm.gpu_type=h100-80gb", "parallel.backend=nccl"]
    for where in ([], gpu):  # a CPU job (node RAM) and a GPU job
        assert main([f"model.path={dense}", *job, *where, f"{option}={value}"]) == 2
        out = capsys.readouterr()
        assert out.err == f"error: {option}: got {float(value)}; valid: a number of GB > 0 (1 GB = 1e9 bytes)\n", out
        assert not out.out
