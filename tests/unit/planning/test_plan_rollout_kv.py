"""The memory plan's check of vLLM's KV cache against the longest sequence on a GPU job
(planning/rollout.py: kv_sequence_bytes, kv_capacity): the bytes of one sequence by the hand rule,
a plan whose cache cannot hold one sequence does not fit (vLLM would refuse to start) and says so
in one line, the capacity note, and `--longest` naming the KV cache where it binds."""
from pathlib import Path

import pytest

from verl_hpc.config import load_config
from verl_hpc.planning import plan_job, refusal
from verl_hpc.planning.longest import longest
from verl_hpc.planning.model_shape import job_arch
from verl_hpc.planning.rollout import kv_sequence_bytes

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
PPO_64K = str(CONFIGS / "ppo_70b_64k.yaml")
GiB = 2**30


def test_one_sequence_of_70b_by_hand():
    """Llama 3.1 70B: 80 layers, 8 KV heads of 128, bf16, at inference TP 8 one KV head per rank:
    2 (K, V) x 80 x 1 x 128 x 2 bytes = 40,960 bytes a token; 66,560 tokens = 4,160 blocks of 16
    plus vLLM's null block. Over TP 16 the head is replicated (vLLM keeps at least one per rank)."""
    arch = job_arch(load_config(PPO_64K))
    assert kv_sequence_bytes(arch, 66560, tp=8, dtype_bytes=2) == 4161 * 16 * 40960
    assert kv_sequence_bytes(arch, 66560, tp=16, dtype_bytes=2) == 4161 * 16 * 40960
    assert kv_sequence_bytes(arch, 66561, tp=4, dtype_bytes=2) == 4162 * 16 * 2 * 40960


def test_the_shipped_64k_config_notes_its_capacity():
    plan = plan_job(load_config(PPO_64K))
    assert plan.fits() and not plan.blocking
    note = next(n for n in plan.notes if n.startswith("vLLM's KV cache:"))
    assert "one sequence of 66560 tokens" in note and "2.54 GiB" in note and "waves at full length" in note


def test_a_cache_below_one_sequence_does_not_fit_and_says_why():
    cfg = load_config(PPO_64K, ["rollout.gpu_memory_utilization=0.25"])  # 19.9 GiB: 17.5 of weights, 2.4 < 2.54 of KV
    plan = plan_job(cfg)
    assert not plan.fits() and len(plan.blocking) == 1
    line = refusal(plan, "python -m verl_hpc.plan --suggest")
    assert line.startswith("memory plan: vLLM's KV cache would be ") and "\n" not in line
    assert "one sequence of 66560 tokens" in line and "vLLM refuses to start" in line
    assert "rollout.tp" in line and "rollout.gpu_memory_utilization" in line
    # the same layout with a shorter response fits again: the rule is the sequence's, not the peak's
    assert plan_job(load_config(PPO_64K, ["rollout.gpu_memory_utilization=0.25",
                                          "data.max_response_length=32768"])).fits()


def test_the_kv_rule_is_only_for_vllm_on_gpus():
    assert not plan_job(load_config(PPO_64K, ["rollout.gpu_memory_utilization=0.25", "rollout.engine=hf"])).blocking


def test_longest_names_the_kv_cache_when_it_binds():
    """At a small vLLM share the KV cache stops the response before the training memory does: the
    row's longest response is the last length whose one sequence fits the cache, exactly (the
    lengths below the micro-batch token budget are judged at the budget for the training memory,
    but at their own length for the cache)."""
    extra = ["rollout.gpu_memory_utilization=0.25"]
    row = next(r for r in longest(load_config(PPO_64K, extra)).rows if r.own)
    assert row.binds.startswith("vLLM's KV cache") and 32768 < row.longest < 65536
    at = plan_job(load_config(PPO_64K, extra + [f"data.max_response_length={row.longest}"]))
    over = plan_job(load_config(PPO_64K, extra + [f"data.max_response_length={row.longest + 1}"]))
    assert at.fits() and over.blocking and over.fits_memory()
