"""Liger-Kernel's fused GPU kernels for the FSDP engine (`fsdp.liger`): RMSNorm and SwiGLU in the
model as transformers builds it, and the fused linear cross-entropy for the log-probs of the
output layer (head.py), where an update reads log-probs only.

    use, why = liger_choice(fsdp.liger, gpu=has_gpu(), installed=liger_installed())
    apply_liger(model)                                   # before sharding: it swaps modules' forwards
    logp = liger_log_probs(hidden, weight, targets, temperature)

auto (null): on where there is a GPU and `liger_kernel` imports (Triton kernels: never on a CPU,
where the chunked PyTorch path of verl_hpc/engines/logits.py runs); true: required, refused with one
line where either is missing; false: off. The choice is said once at start-up. Entropy and
sum-pi-squared stay on the project's own output layer (engines/logits.py): Liger's fused linear
cross-entropy returns each token's loss (and optionally a z-loss, accuracy, the argmax), never the
distribution's entropy or sum p^2, and its chunked RL losses (GRPO, DPO, ...) compute their own
objective end to end (their clipping, KL and averaging), not the per-token terms this project's
losses are assembled from (docs/logits.md).

Scope: Liger's per-family patch, given a model instance, also rebinds the classes in transformers'
modeling module (`modeling_llama.LlamaMLP = LigerSwiGLUMLP`, `LlamaRMSNorm = LigerRMSNorm`), so
every model of that family built later in the process would be Liger's too, whatever its own
fsdp.liger says (a reference or critic engine, a plain transformers model beside it). apply_liger
puts those module attributes back once the instance is patched: Liger's kernels reach this model
only.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_choice(setting: Optional[bool], *, gpu: bool, installed: bool) -> Tuple[bool, str]:
    """(use Liger's kernels, why) for fsdp.liger = `setting`; true where they cannot run raises."""
    missing = ("this node has no CUDA GPU (Liger's kernels are Triton)" if not gpu
               else "liger-kernel is not installed" if not installed else "")
    if setting is True and missing:
        raise ConfigError(f"fsdp.liger = true, but {missing}; set fsdp.liger=null (auto) or false")
    if setting is False:
        return False, "fsdp.liger = false"
    if missing:
        return False, missing
    return True, "fsdp.liger = " + ("true" if setting else "auto") + ": a GPU and liger-kernel"


def setup_liger(model, options) -> bool:
    """The engine's start-up: decide (fsdp.liger, this node), say it once, patch the model's norms
    and MLPs where on (before sharding: the patch swaps the modules' forwards). Language-model
    heads only: a value model wraps its backbone (build.ValueModel), which Liger's per-family
    patches do not know."""
    import logging

    import torch.distributed as dist

    from verl_hpc.runtime.device import has_gpu

    if options.head != "lm":
        return False
    use, why = liger_choice(getattr(options.fsdp, "liger", None), gpu=has_gpu(), installed=liger_installed())
    if not dist.is_initialized() or dist.get_rank() == 0:
        logging.getLogger(__name__).info("Liger kernels %s (%s)", "on: fused RMSNorm, SwiGLU, linear "
                                         "cross-entropy" if use else "off", why)
    if use:
        apply_liger(model)
    return use


def apply_liger(model) -> None:
    """Liger's RMSNorm and SwiGLU in `model` (its own per-family patch for the model's type), on
    this instance only (modeling_modules_kept); the output layer's loss stays ours (head.py calls the
    fused linear cross-entropy itself). Not Liger's RoPE: that patch replaces a function of the
    modeling module, which every model of the family calls, so it cannot be kept to one instance."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    with modeling_modules_kept(model):
        _apply_liger_kernel_to_instance(model=model, rms_norm=True, swiglu=True, rope=False, cross_entropy=False,
                                        fused_linear_cross_entropy=False)


@contextlib.contextmanager
def modeling_modules_kept(model):
    """The attributes of the transformers modules `model`'s classes come from (its modeling
    modules), as they were on entry: Liger's per-instance patch also swaps the family's classes and
    functions there (module docstring)."""
    parts = model.modules() if isinstance(model, torch.nn.Module) else ()
    names = {type(m).__module__ for m in parts} | {type(model).__module__}
    modules = [sys.modules[n] for n in sorted(names) if n.startswith("transformers.") and n in sys.modules]
    saved = [(mod, dict(vars(mod))) for mod in modules]
    try:
        yield
    finally:
        for mod, before in saved:
            for name, value in list(vars(mod).items()):
                if name in before and before[name] is not value:
                    setattr(mod, name, before[name])


def liger_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """log softmax(hidden @ weight.T / temperature)[target] per token, `targets`' shape, from Liger's
    fused linear cross-entropy (reduction none: each token's -log p). The temperature divides the
    hidden states: (h / t) W^T = (h W^T) / t, without the logits."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    flat = hidden.reshape(-1, hidden.shape[-1])
    if temperature != 1.0:
        flat = flat / temperature
    nll = LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, flat, targets.reshape(-1))
    return (-nll.float()).view(targets.shape)
