"""The vLLM set of the GPU kit (`python -m verl_hpc.gpu_check --set vllm`): what the vLLM checks
need first (the toolchain, the runtime, Megatron's parallel state), then vllm_checks.py's and
vllm_speed.py's checks in the order they run."""
from __future__ import annotations

from typing import List

from verl_hpc.gpu_check import vllm_checks, vllm_speed
from verl_hpc.gpu_check.kit import Check


def checks() -> List[Check]:
    from verl_hpc.gpu_check import checks as base

    ready = ("compile_toolchain", "nccl_bootstrap", "megatron_parallel")
    machine = "1 GPU + vLLM (make gpu-vllm-kit)"
    by_name = {c.name: c for c in base.CHECKS}
    return [by_name[n] for n in ready] + [
        Check("vllm_beside_megatron", "vLLM beside the Megatron engine in one process: sync, generate, the "
              "mismatch metric within the bf16 bound, a train step with vLLM asleep", vllm_checks.beside_megatron, ready, machine),
        Check("vllm_beside_fsdp", "the same beside the FSDP engine", vllm_checks.beside_fsdp, ("nccl_bootstrap",), machine),
        Check("vllm_sleep_levels", "sleep levels 1 and 2: memory freed and mapped back (mem_get_info), a train "
              "step's peak with vLLM asleep", vllm_checks.sleep_levels, ready, machine),
        Check("vllm_weight_sync", "the weight sync full and sliced (tp 1) into vLLM: seconds, GB/s against the "
              "device's copy, served weights read back bitwise after each of several syncs",
              vllm_speed.weight_sync, ready, machine),
        Check("vllm_ngram", "n-gram speculation: greedy identical with and without, tokens/s of each",
              vllm_speed.ngram, (), machine),
        Check("vllm_vs_hf", "rollout tokens/s: vLLM against HF generate on the same prompts and lengths",
              vllm_speed.vs_hf, (), machine),
    ]
