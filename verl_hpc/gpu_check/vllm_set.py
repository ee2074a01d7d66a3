"""The vLLM set of the GPU kit (`python -m verl_hpc.gpu_check --set vllm`): what the vLLM checks
need first (the toolchain, the runtime, Megatron's parallel state), then vllm_checks.py's,
vllm_graphs.py's and vllm_speed.py's checks in the order they run, each with its time budget.

The budgets are twice a stated estimate for one H200 (no vLLM has run on a GPU here yet: the first
run's seconds, recorded per check in OUT/vllm_check/gpu_check.json, replace them): an eager engine
of the kit's tiny model builds in about 15 s (vLLM's start, a profile run, a KV cache of
UTILIZATION of the GPU), a compiled one with CUDA graphs in about 60 s (Inductor, then about 11
capture sizes with max_num_seqs 32), the Megatron and FSDP engines in about 5 s, a sync or a
generation of the kit's prompts in well under a second. A check past its budget is stopped
(TIMEOUT) and the next one runs; VLLM_STEP_S is the whole set's limit in `make gpu-all`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

from verl_hpc.gpu_check import vllm_checks, vllm_graphs, vllm_speed
from verl_hpc.gpu_check.kit import Check

# stated estimates (s) on one H200, from the parts above; a check's budget is twice its estimate
ESTIMATE_S: Dict[str, float] = {
    "compile_toolchain": 5, "nccl_bootstrap": 10, "megatron_parallel": 10,
    "vllm_beside_megatron": 35,  # an eager engine, the Megatron engine, two phases
    "vllm_beside_fsdp": 30,
    "vllm_sleep_levels": 45,  # two eager engines, a sleep and a wake each, two train steps
    "vllm_weight_sync": 30,  # an eager engine, six syncs with the served weights read back
    "vllm_graphs_reload": 90,  # a compiled engine with graphs, three syncs, two sleeps; an eager one
    "vllm_ngram": 35,  # two eager engines
    "vllm_vs_hf": 70,  # a compiled engine, HF generate
}
STARTUP_S = 30  # the interpreter's imports (torch, vLLM, Megatron-Core) before the first check
VLLM_STEP_S = STARTUP_S + sum(ESTIMATE_S.values()) + 30  # the set's limit in make gpu-all, with a margin


def checks() -> List[Check]:
    from verl_hpc.gpu_check import checks as base

    ready = ("compile_toolchain", "nccl_bootstrap", "megatron_parallel")
    machine = "1 GPU + vLLM (make gpu-vllm-kit)"
    by_name = {c.name: c for c in base.CHECKS}
    listed = [by_name[n] for n in ready] + [
        Check("vllm_beside_megatron", "vLLM beside the Megatron engine in one process: sync, generate, the "
              "mismatch metric within the bf16 bound, a train step with vLLM asleep", vllm_checks.beside_megatron, ready, machine),
        Check("vllm_beside_fsdp", "the same beside the FSDP engine", vllm_checks.beside_fsdp, ("nccl_bootstrap",), machine),
        Check("vllm_sleep_levels", "sleep levels 1 and 2: memory freed and mapped back (mem_get_info), a train "
              "step's peak with vLLM asleep", vllm_checks.sleep_levels, ready, machine),
        Check("vllm_weight_sync", "the weight sync full and sliced (tp 1) into vLLM: seconds, GB/s against the "
              "device's copy, served weights read back bitwise after each of several syncs",
              vllm_speed.weight_sync, ready, machine),
        Check("vllm_graphs_reload", "CUDA graphs after 3 syncs and 2 level-2 sleeps: greedy tokens equal an eager "
              "engine's with the same weights", vllm_graphs.graphs_reload, ready, machine),
        Check("vllm_ngram", "n-gram speculation: greedy identical with and without, tokens/s of each",
              vllm_speed.ngram, (), machine),
        Check("vllm_vs_hf", "rollout tokens/s: vLLM against HF generate on the same prompts and lengths",
              vllm_speed.vs_hf, (), machine),
    ]
    return [dataclasses.replace(c, budget_s=2 * ESTIMATE_S[c.name]) for c in listed]
