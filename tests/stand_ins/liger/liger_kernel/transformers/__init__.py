"""Stand-in for liger_kernel.transformers: the per-instance patch swaps the family's classes in
the modeling module as the real one does (monkey_patch.apply_liger_kernel_to_llama), binds
LigerSwiGLUMLP's forward (no act_fn) on the instance, and the fused linear cross-entropy is torch's."""
import sys

import torch


class LigerSwiGLUMLP(torch.nn.Module):
    def __init__(self, config, *a, **k):
        super().__init__()
        self.gate_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LigerRMSNorm(torch.nn.Module):
    pass


def _bind(module, name, fn):
    module.__dict__[name] = fn.__get__(module, module.__class__)


def _apply_liger_kernel_to_instance(model, rms_norm=True, swiglu=True, rope=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False):
    modeling = sys.modules[type(model).__module__]
    if swiglu:
        modeling.LlamaMLP = LigerSwiGLUMLP
    if rms_norm:
        modeling.LlamaRMSNorm = LigerRMSNorm
    if rope:
        modeling.apply_rotary_pos_emb = modeling.apply_rotary_pos_emb  # rebinding, as Liger's does
    base = getattr(model, model.base_model_prefix, model)
    for layer in base.layers:
        if swiglu:
            _bind(layer.mlp, "forward", LigerSwiGLUMLP.forward)
            _bind(layer.mlp, "_get_name", lambda self: "LigerSwiGLUMLP")
            del layer.mlp.act_fn  # Liger's MLP has none
        if rms_norm:
            _bind(layer.input_layernorm, "_get_name", lambda self: "LigerRMSNorm")


class LigerFusedLinearCrossEntropyLoss:
    def __init__(self, reduction="mean"):
        self.reduction = reduction

    def __call__(self, weight, x, target):
        return torch.nn.functional.cross_entropy((x @ weight.t().to(x.dtype)).float(), target, reduction=self.reduction)
