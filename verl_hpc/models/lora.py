"""Low-rank adapters on Megatron's tensor-parallel linear layers, and their PEFT tensors (the
names and layout rules are models/lora_names.py).

    attach_adapters(chunks, AdapterSpec(rank, alpha, dropout, targets, init), seed=1)
    with adapters_off(chunks): ...                 # the base model, bitwise (the reference policy)
    for peft_name, tensor in export_adapter(chunks): ...   # PEFT-named full tensors, every rank
    load_adapter(chunks, peft_tensors)             # this rank's shards from PEFT-named tensors

A targeted linear layer computes `W x + scale * B A x` with A: [r, in] and B: [out, r], scale =
alpha / r (alpha / sqrt(r) with rank-stabilised LoRA, `use_rslora`, as PEFT computes it).
Each factor is split over the TP ranks so that the adapter needs no gather of a full-width
tensor, only of its r-wide middle `z = A x`:

- column-parallel layers (linear_qkv, linear_fc1: W split by output rows): A is whole on every
  TP rank, B is split by rows like W. `z` passes Megatron's copy-to-TP region (backward:
  all-reduce of dz, to which each rank's B slice adds a part); under sequence parallelism `z` is
  all-gathered over the sequence instead (backward: reduce-scatter), and A's gradient, partial
  over the sequence shards, is all-reduced with the other sequence-parallel parameters.
- row-parallel layers (linear_proj, linear_fc2: W split by input columns): A is split by
  columns like W, B is whole. `z` is summed over TP (all-reduce; under sequence parallelism a
  reduce-scatter, and B's gradient is all-reduced as above).

The factors are parameters of the linear module itself (`linear_qkv.lora_A`, `.lora_B`), so
Megatron's DDP, optimizer and gradient-norm code see them with the usual TP attributes, and the
base weight keeps its name. A forward hook adds the adapter's output; `adapters_off` makes the
hook add nothing, so the output is the base model's exactly.

PEFT layout: the fused linear_qkv is q_proj, k_proj and v_proj in HF, each with its own
lora_A/lora_B in a PEFT file. One A shared by q, k and v is exactly PEFT's three adapters with
equal A (B's rows split into q, k and v as the weight's are); linear_fc1 is gate_proj and up_proj
alike. So an adapter exports to PEFT without approximation. That is what this project trains
(`per_module_a` false: the fused layer's adapter costs one A). An adapter trained by stock PEFT
has an independent A per module; with `per_module_a` the fused layer holds them all, A as
[parts * r, in] (module k's A in rows k*r..), and each output row of B multiplies only its own
module's part of z = A x: a block-structured B kept block-structured by construction, stored as
the plain [out, r] (each row's module is fixed by the layout), so training, checkpoints and the
export see PEFT's factors exactly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.lora import LORA_TARGETS as TARGETS
from verl_hpc.config.sections.lora import lora_scale
from verl_hpc.models.lora_names import COLUMN_TARGETS, HF_MODULES, PeftReader, factor_hf_entries, factor_rule, to_peft
from verl_hpc.models.weight_rules import Layout

_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
           "linear_fc1": "mlp", "linear_fc2": "mlp"}


@dataclasses.dataclass
class AdapterSpec:
    rank: int
    alpha: float
    dropout: float
    targets: Tuple[str, ...]
    init: str  # lora.init
    use_rslora: bool = False  # scale alpha / sqrt(rank) (lora.use_rslora)
    per_module_a: bool = False  # the fused layers hold one A per HF module (module docstring)

    @classmethod
    def from_config(cls, lora) -> "AdapterSpec":
        """The adapter the job's lora section asks for (per_module_a comes from lora.init_from's
        files: engines/megatron/lora.py read_peft_folder)."""
        return cls(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.target_modules),
                   init=lora.init, use_rslora=lora.use_rslora)

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.use_rslora)

    def parts(self, target: str) -> int:
        """How many A a target's layer holds: its HF modules' count for a fused column layer under
        per_module_a, else 1."""
        return len(HF_MODULES[target]) if self.per_module_a and target in COLUMN_TARGETS else 1


# ----------------------------------------------------------------------------- the layers


def init_a(spec: AdapterSpec, full_in: int, seed: int, layer: int, target: str) -> torch.Tensor:
    """A [parts * r, in] of one layer and target, the same whatever the parallel layout (a
    generator seeded by the job seed, the layer and the target), so runs at any TP/PP start alike."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 8 + TARGETS.index(target))
    a = torch.empty(spec.rank * spec.parts(target), full_in)
    if spec.init == "gaussian":
        a.normal_(0.0, 1.0 / spec.rank, generator=gen)
    else:  # PEFT's default: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in))
        bound = 1.0 / math.sqrt(full_in)
        a.uniform_(-bound, bound, generator=gen)
    return a


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _adapter_input(module, x: torch.Tensor) -> torch.Tensor:
    """The input the base weight multiplies. Transformer Engine's LayerNorm-linear layers take the
    un-normalised input and normalise inside; the adapter must see the normalised one."""
    norm_w = getattr(module, "layer_norm_weight", None)
    if norm_w is None:
        return x
    cfg = module.config
    w = norm_w + 1 if getattr(cfg, "layernorm_zero_centered_gamma", False) else norm_w
    if cfg.normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), w, cfg.layernorm_epsilon)
    return F.layer_norm(x, (x.shape[-1],), w, getattr(module, "layer_norm_bias", None), cfg.layernorm_epsilon)


def _delta(module, x: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel as tpl

    x = _adapter_input(module, x)
    if module.training and module.lora_dropout > 0:
        x = F.dropout(x, module.lora_dropout)  # the default stream: equal on a stage's TP ranks
    z = F.linear(x.to(module.lora_A.dtype), module.lora_A)
    sp = module.lora_sequence_parallel
    if module.lora_kind == "column":
        z = (tpl.gather_from_sequence_parallel_region(z) if sp
             else tpl.copy_to_tensor_model_parallel_region(z))
    else:
        z = (tpl.reduce_scatter_to_sequence_parallel_region(z) if sp
             else tpl.reduce_from_tensor_model_parallel_region(z))
    if module.lora_rows is None:
        return F.linear(z, module.lora_B) * module.lora_scale
    # one A per HF module: each module's rows of B take that module's r-wide part of z
    r = module.lora_B.shape[1]
    out = [F.linear(zp, module.lora_B.index_select(0, rows)) for zp, rows in zip(z.split(r, -1), module.lora_rows)]
    return torch.cat(out, -1).index_select(-1, module.lora_inverse) * module.lora_scale


def _hook(module, args, output):
    if not module.lora_enabled:
        return None
    out, bias = output
    return out + _delta(module, args[0]).to(out.dtype), bias


def _row_parts(arch, target: str, layer: int, lay: Layout) -> torch.Tensor:
    """Which HF module (0, 1, 2 for q, k, v; 0, 1 for gate, up) each of this TP rank's output rows
    of a fused layer belongs to: B's own layout rule applied to rows labelled by module."""
    labels = {name: torch.full(shape, float(k))
              for k, (name, shape) in enumerate(factor_hf_entries(arch, target, "B", layer, 1))}
    return factor_rule(target, "B").load(PeftReader(labels, "B"), arch, layer, lay)[:, 0].long()


def _attach_one(module, spec: AdapterSpec, kind: str, a_full: torch.Tensor, sequence_parallel: bool,
                row_parts: Optional[torch.Tensor] = None):
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    tp_rank, tp = _tp()
    weight = module.weight
    out_local, in_local = weight.shape
    dev = weight.device
    # A whole (column) or this rank's columns (row); B's rows are the weight's (zero: a fresh
    # adapter adds nothing)
    a = a_full if kind == "column" else a_full[:, tp_rank * in_local:(tp_rank + 1) * in_local]
    b = torch.zeros(out_local, spec.rank)
    # fp32 factors whatever the base's dtype: they are small, and Megatron's optimizer keeps an
    # fp32 main copy of a bf16 parameter anyway
    module.lora_A = torch.nn.Parameter(a.to(dev).contiguous())
    module.lora_B = torch.nn.Parameter(b.to(dev))
    split, replicated = (module.lora_B, module.lora_A) if kind == "column" else (module.lora_A, module.lora_B)
    if tp > 1:
        set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
    if sequence_parallel:  # its gradient is partial over the sequence shards: all-reduced over TP
        replicated.sequence_parallel = True
    for p in (module.lora_A, module.lora_B):
        p.hf_adapter = True  # not in an HF folder: load_hf_weights and export_hf_weights skip it
    # export_hf_weights sends what this returns for the weight: merged while the adapter is on
    module.exported_weight = lambda m=module: merged_weight(m) if m.lora_enabled else m.weight
    module.lora_kind, module.lora_scale, module.lora_dropout = kind, spec.scale, spec.dropout
    module.lora_sequence_parallel, module.lora_enabled = sequence_parallel, True
    module.lora_rows = module.lora_inverse = None
    if row_parts is not None:  # per-module A: the rows of each module, and where they go back
        module.lora_rows = [torch.nonzero(row_parts == k).flatten().to(dev) for k in range(int(row_parts.max()) + 1)]
        module.lora_inverse = torch.argsort(torch.cat(module.lora_rows))
    module.register_forward_hook(_hook)


def adapted_modules(chunk) -> Iterator[Tuple[int, str, torch.nn.Module]]:
    """(stage-local layer index, target, linear module) of the adapted layers of one GPT chunk."""
    for j, layer in enumerate(chunk.decoder.layers):
        for target, parent in _PARENT.items():
            module = getattr(getattr(layer, parent, None), target, None)
            if module is not None and hasattr(module, "lora_A"):
                yield j, target, module


def _chunks(model) -> list:
    from verl_hpc.models.weights import _chunks as unwrap

    return unwrap(model)


def attach_adapters(model, spec: AdapterSpec, *, seed: int, sequence_parallel: bool = False) -> int:
    """Give every targeted linear layer of this rank's chunks a fresh adapter (B = 0, so the model
    computes what it did); returns this rank's adapter parameter count."""
    from verl_hpc.models.weights import _layout

    count = 0
    for chunk in _chunks(model):
        lay = _layout(chunk)
        for layer in chunk.decoder.layers:
            for target in spec.targets:
                module = getattr(getattr(layer, _PARENT[target]), target)
                kind = "column" if target in COLUMN_TARGETS else "row"
                if kind == "column" and getattr(module, "gather_output", False):
                    raise ValueError(f"{target}: a column-parallel layer that gathers its output "
                                     "is not a decoder layer's; LoRA expects Megatron's GPT layers")
                in_full = module.weight.shape[1] * (_tp()[1] if kind == "row" else 1)
                a_full = init_a(spec, in_full, seed, layer.layer_number - 1, target)
                parts = (_row_parts(chunk.verl_arch, target, layer.layer_number - 1, lay)
                         if spec.parts(target) > 1 else None)
                _attach_one(module, spec, kind, a_full, sequence_parallel, parts)
                count += module.lora_A.numel() + module.lora_B.numel()
    return count


def adapter_parameters(model) -> List[torch.nn.Parameter]:
    return [p for chunk in _chunks(model) for _, _, m in adapted_modules(chunk) for p in (m.lora_A, m.lora_B)]


@contextlib.contextmanager
def adapters_off(model):
    """The base model: every adapter's hook adds nothing while the block runs."""
    modules = [m for chunk in _chunks(model) for _, _, m in adapted_modules(chunk)]
    before = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, was in zip(modules, before):
            m.lora_enabled = was


def merged_weight(module) -> torch.Tensor:
    """This rank's shard of W + scale * B A, in W's layout and dtype (no parameter is changed)."""
    with torch.no_grad():
        a, b = module.lora_A.float(), module.lora_B.float()
        if module.lora_rows is None:
            delta = b @ a
        else:  # each module's rows times its own A
            blocks = [b.index_select(0, rows) @ ap for rows, ap in zip(module.lora_rows, a.split(b.shape[1]))]
            delta = torch.cat(blocks).index_select(0, module.lora_inverse)
        return (module.weight.float() + delta * module.lora_scale).to(module.weight.dtype)


# ----------------------------------------------------------------------------- PEFT tensors


def adapter_items(chunk):
    """(stage-local layer index, target, factor, parameter, rule, rank) of one chunk, in export order."""
    for j, target, module in adapted_modules(chunk):
        for factor in ("A", "B"):
            yield (j, target, factor, getattr(module, f"lora_{factor}"),
                   factor_rule(target, factor, module.lora_rows is not None), module.lora_B.shape[1])


def load_adapter(model, tensors: Dict[str, torch.Tensor]) -> int:
    """Fill this rank's adapter shards from PEFT-named full tensors (a PEFT adapter_model file);
    returns the number of factors filled. Every adapted layer must find its tensors."""
    from verl_hpc.models.weights import _layer_numbers, _layout

    filled = 0
    for chunk in _chunks(model):
        arch, lay, layers = chunk.verl_arch, _layout(chunk), _layer_numbers(chunk)
        for j, target, factor, param, rule, rank in adapter_items(chunk):
            shard = rule.load(PeftReader(tensors, factor), arch, layers[j], lay)
            if tuple(shard.shape) != tuple(param.shape):
                raise ConfigError(f"layer {layers[j]} {target} lora_{factor}: the adapter gives shape "
                                  f"{tuple(shard.shape)} for TP rank {lay.tp_rank}/{lay.tp}, the model "
                                  f"expects {tuple(param.shape)} (is its rank {rank}?)")
            with torch.no_grad():
                param.copy_(shard)
            filled += 1
    return filled


def _adapter_items(chunk):
    from verl_hpc.models.weights import _layer_numbers

    layers = _layer_numbers(chunk)
    for j, target, factor, param, rule, _ in adapter_items(chunk):
        yield param, rule, layers[j], (lambda full, arch, layer, lay, r=rule, f=factor:
                                       to_peft(r, full, arch, layer, lay, f))


def _adapter_entries(chunk):
    from verl_hpc.models.weights import _layer_numbers

    layers = _layer_numbers(chunk)
    for j, target, factor, _, _, rank in adapter_items(chunk):
        yield from factor_hf_entries(chunk.verl_arch, target, factor, layers[j], rank)


def export_adapter(model, *, all_stages: bool = True,
                   dtype: torch.dtype = torch.float32) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield `(peft_name, full_tensor)` of every adapter factor, on every rank, in the same order
    (the contract of verl_hpc.models.weights.export_hf_weights, PEFT names instead of HF's).
    A collective iterator over the model-parallel ranks. fp32 by default: the factors' own dtype."""
    from verl_hpc.models.weights import export_stages

    yield from export_stages(model, _adapter_items, _adapter_entries, all_stages=all_stages, dtype=dtype)
