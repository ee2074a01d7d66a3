"""Which fused kernels and communication overlaps the Megatron engine turns on, and why.

    switches = KernelSwitches.from_config(cfg.model, cfg.parallel)   # what the user asked for
    perf = switches.resolve(trainable=True, use_distributed_optimizer=True)  # on this rank
    transformer_config(..., **perf.transformer_overrides())

Every switch is `None` (auto), `True` or `False`. Auto turns a feature on exactly where its kernel
exists on this rank, so CPU runs keep the exact unfused paths Megatron's CPU code is verified with:
- bias_activation_fusion: Megatron's fused SwiGLU (a torch.compile/jit kernel): needs a GPU.
- cross_entropy_loss_fusion: Megatron's native fused vocab-parallel cross-entropy (its jit_fuser,
  torch.compile; `cross_entropy_fusion_impl = native`, not TE's): needs a GPU. Used for bf16 logits
  only (its backward returns a bf16 gradient): Megatron's labels path and the engine's whole-logits
  log-probs (outputs.lm_outputs).
- apply_rope_fusion: Megatron calls Transformer Engine's fused RoPE (TransformerConfig refuses it
  without TE): needs a GPU and TE.
- gradient_accumulation_fusion: the weight-gradient GEMM accumulates straight into Megatron's fp32
  `main_grad`. Megatron's own linear layers (the output layer even with the TE spec) need apex's
  `fused_weight_gradient_mlp_cuda` extension for it, TE's layers do it themselves: needs a GPU and
  that extension (the project's image does not ship apex, so auto leaves it off there).
- overlap_grad_reduce: DDP reduces gradient buckets while backward still runs (async collectives).
- overlap_param_gather: the distributed optimizer's parameter all-gather runs during the next
  forward; needs use_distributed_optimizer.
  Neither needs a kernel: `true` runs on CPU with gloo too (the CPU suite trains with both on, at
  dp 1 and 2, and compares with them off); auto turns them on with a GPU only. The engine forces the gather before anything reads the
  parameters outside a forward (weight export, checkpoint): see engine.py `_sync_params`.
Frozen engines (reference, reward model) have no gradients: the three gradient features stay off.
An explicit `True` where the kernel is missing is an error naming the field, raised before any
model is built (identically on every rank).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Dict, List, Optional

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.gpt import transformer_engine_available
from verl_hpc.runtime.device import has_gpu


def grad_accum_extension_available() -> bool:
    """apex's CUDA extension Megatron's linear layers need for gradient-accumulation fusion."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


@dataclasses.dataclass(frozen=True)
class Availability:
    gpu: bool
    te: bool
    grad_accum_ext: bool

    @classmethod
    def detect(cls) -> "Availability":
        gpu = has_gpu()
        return cls(gpu=gpu, te=gpu and transformer_engine_available(),
                   grad_accum_ext=gpu and grad_accum_extension_available())


@dataclasses.dataclass(frozen=True)
class PerfOptions:
    """Resolved: plain booleans, what the engine passes to Megatron."""

    bias_activation_fusion: bool = False
    apply_rope_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    cross_entropy_loss_fusion: bool = False

    def transformer_overrides(self) -> Dict[str, Any]:
        out: Dict[str, Any] = dict(bias_activation_fusion=self.bias_activation_fusion,
                                   apply_rope_fusion=self.apply_rope_fusion,
                                   gradient_accumulation_fusion=self.gradient_accumulation_fusion)
        if self.cross_entropy_loss_fusion:  # Megatron's own kernel, not Transformer Engine's
            out.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
        return out


@dataclasses.dataclass(frozen=True)
class KernelSwitches:
    """Requested: None = auto. Field names are the config keys' last parts."""

    bias_activation_fusion: Optional[bool] = None
    apply_rope_fusion: Optional[bool] = None
    gradient_accumulation_fusion: Optional[bool] = None
    overlap_grad_reduce: Optional[bool] = None
    overlap_param_gather: Optional[bool] = None
    cross_entropy_loss_fusion: Optional[bool] = None

    @classmethod
    def from_config(cls, model_cfg, parallel_cfg) -> "KernelSwitches":
        return cls(bias_activation_fusion=model_cfg.bias_activation_fusion,
                   apply_rope_fusion=model_cfg.apply_rope_fusion,
                   gradient_accumulation_fusion=model_cfg.gradient_accumulation_fusion,
                   overlap_grad_reduce=parallel_cfg.overlap_grad_reduce,
                   overlap_param_gather=parallel_cfg.overlap_param_gather,
                   cross_entropy_loss_fusion=getattr(model_cfg, "cross_entropy_loss_fusion", None))

    def resolve(self, *, trainable: bool, use_distributed_optimizer: bool,
                available: Optional[Availability] = None) -> PerfOptions:
        a = available or Availability.detect()
        rules = {  # field: (config key, kernel present?, what is missing otherwise)
            "bias_activation_fusion": ("model", a.gpu, "a CUDA GPU"),
            "cross_entropy_loss_fusion": ("model", a.gpu, "a CUDA GPU"),
            "apply_rope_fusion": ("model", a.gpu and a.te, "a CUDA GPU and Transformer Engine"),
            "gradient_accumulation_fusion": (
                "model", a.gpu and a.grad_accum_ext,
                "a CUDA GPU and apex's fused_weight_gradient_mlp_cuda extension"),
            # no kernel: asynchronous collectives, which gloo runs too (the CPU suite trains with
            # both on); auto keeps them to GPUs, where the reduce overlaps real compute
            "overlap_grad_reduce": ("parallel", True, ""),
            "overlap_param_gather": ("parallel", use_distributed_optimizer,
                                     "parallel.use_distributed_optimizer=true"),
        }
        auto_on = {"overlap_grad_reduce": a.gpu, "overlap_param_gather": a.gpu and use_distributed_optimizer}
        grads_only = ("gradient_accumulation_fusion", "overlap_grad_reduce", "overlap_param_gather")
        out = {}
        for name, (section, present, needs) in rules.items():
            asked = getattr(self, name)
            if asked and not present:
                raise ConfigError(f"{section}.{name}=true needs {needs}, which this rank lacks; set "
                                  f"it to null (auto: on where the kernel exists) or false")
            on = auto_on.get(name, present) if asked is None else bool(asked)
            out[name] = on and (trainable or name not in grads_only)
        return PerfOptions(**out)


# torch's norm classes Megatron's local spec builds without apex (megatron.core.transformer.torch_norm
# WrappedTorchNorm returns one of these, made in torch's default dtype: fp32)
TORCH_NORMS = ("RMSNorm", "LayerNorm")


def norms_in_compute_dtype(chunks: List[Any], dtype) -> int:
    """Cast torch's own norm modules in `chunks` to `dtype`, the dtype Megatron builds its other
    weights in (TransformerConfig.params_dtype); returns how many were cast.

    Why: Megatron's local spec without apex builds torch.nn.RMSNorm / LayerNorm through
    WrappedTorchNorm, which takes no dtype, so their weights stay fp32 while every other weight and
    the activations are bf16, and torch's fused rms_norm refuses mixed dtypes ("Mismatch dtype
    between input and weight ... Cannot dispatch to fused implementation"): every norm then runs as
    several unfused kernels with fp32 upcasts. Megatron-LM's own training loop gets bf16 norms by
    wrapping the model in Float16Module, which casts the whole model to bf16; the engine does not
    use that wrapper (its outputs stay in the compute dtype), so it casts only these modules, whose
    weights are the only ones left behind. Megatron's mixed-precision optimizer then keeps their fp32
    master copies like any other bf16 weight. Apex's and Transformer Engine's norms are made in
    params_dtype already and are left alone."""
    count = 0
    for gpt in chunks:
        for m in gpt.modules():
            if type(m).__name__ in TORCH_NORMS and type(m).__module__.startswith("torch.nn"):
                if any(p.dtype != dtype for p in m.parameters(recurse=False)):
                    m.to(dtype=dtype)
                    count += 1
    return count


def kernel_report(chunks: List[Any], perf: PerfOptions) -> Dict[str, str]:
    """What each part of a layer runs, read from the built modules and the resolved switches: the
    engine's start-up line and the benchmark's kernels column."""
    layer = chunks[0].decoder.layers[0]
    norm = layer.input_layernorm
    if type(norm).__name__ == "IdentityOp":  # TE spec: the norm is fused into the QKV GEMM
        norm_desc = f"fused into {type(layer.self_attention.linear_qkv).__name__} (Transformer Engine)"
    else:
        w = getattr(norm, "weight", None)
        wdt = str(w.dtype).replace("torch.", "") if w is not None else "-"
        params_dtype = str(chunks[0].config.params_dtype).replace("torch.", "")
        torch_norm = type(norm).__module__.startswith("torch.nn")
        fused = ("torch's fused rms_norm" if wdt == params_dtype
                 else f"unfused: weight {wdt}, input {params_dtype}") if torch_norm else "apex"
        norm_desc = f"{type(norm).__module__}.{type(norm).__qualname__}, weight {wdt} ({fused})"
    core = layer.self_attention.core_attention
    fuser = _jit_fuser_name()
    return {
        "norm": norm_desc,
        "attention": type(core).__name__ + (" (torch SDPA)" if type(core).__name__ == "SdpaCoreAttention" else ""),
        "swiglu": (f"fused (Megatron's bias_swiglu, jit_fuser = {fuser})" if perf.bias_activation_fusion
                   else "unfused (torch ops)"),
        "rope": "fused (Transformer Engine)" if perf.apply_rope_fusion else "unfused (torch ops; Megatron's fused RoPE is TE's)",
        "cross-entropy": ("Megatron's fused vocab-parallel cross-entropy (native, jit_fuser = " + fuser + ") for "
                          "whole bf16 logits" if getattr(chunks[0].config, "cross_entropy_loss_fusion", False) else
                          "Megatron's vocab-parallel cross-entropy (unfused) for whole logits")
                         + "; chunks: engines/logits.py",
        "grad-accum fusion": "on" if perf.gradient_accumulation_fusion else "off",
    }


def _jit_fuser_name() -> str:
    try:
        from megatron.core import jit
    except ImportError:  # pragma: no cover - megatron is there whenever chunks are
        return "?"
    return getattr(jit.jit_fuser, "__name__", str(jit.jit_fuser))
