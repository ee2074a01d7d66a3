"""The Megatron engine's state as layout-independent slabs (contract: verl_hpc/engines/base.py).

Every parameter of this rank becomes one or more *pieces* of logical tensors whose names and
global shapes do not depend on TP/PP/DP/VPP:
- layer names carry the global layer number (`decoder.layers.{layer_number - 1}`), not the
  stage-local index; Transformer Engine's fused-norm names map to the local spec's;
- TP-split weights are slabs at `tp_rank * local_size` along their partition dim;
- the vocabulary (embedding, untied output layer) has the model's real size: Megatron's TP padding
  rows are cut off (they are zero and never trained);
- `linear_fc1` holds [gate_r; up_r] per TP rank, so its gathered layout changes with TP; it is
  stored as two tensors `.../gate` and `.../up` of shape [ffn, hidden] instead;
- a routed expert of an MoE layer is `decoder.layers.{L}.mlp.experts.{e}.*` with its global index
  e (not the expert-parallel rank's local one), split over the expert-TP group, so a state saved at
  one expert-parallel size loads at another;
- with tied embeddings and pp > 1 the last stage's copy of the embedding is not saved; on load it
  is filled from the embedding's slabs like any other target;
- under LoRA only the adapter factors (`.../linear_qkv.lora_A`, ...; linear_fc1's lora_B split
  into gate and up like its weight) and their optimizer states are saved; the meta names the
  base model by path and fingerprint, and a load into another base is refused.
The FSDP engine writes these same names for the families both engines hold (its format
`verl_hpc.fsdp_engine/1` with `coords: megatron`; verl_hpc/engines/fsdp/state.py), and this engine
loads them: its fp32 `model/` tensors are the master weights, so a bf16 engine takes its
`optim/main` from them. An FSDP state in HF names (an architecture Megatron does not map) is refused.
Optimizer states follow their parameter's pieces. With the distributed optimizer a rank holds a
flat element range of each parameter's local shard: it is cut into boxes (rows, or parts of a
row) with verl_hpc.checkpoint's `flat_range_slabs` and each box into the pieces it crosses.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_hpc.checkpoint.errors import CheckpointLayoutError
from verl_hpc.checkpoint.sharded import ShardedTensor, flat_range_slabs
from verl_hpc.engines.base import EngineState
from verl_hpc.engines.state_check import check_same_model, model_shapes
from verl_hpc.engines.megatron.lora import check_state_meta as check_lora_meta
from verl_hpc.engines.megatron.lora import state_meta as lora_state_meta
from verl_hpc.engines.megatron.optim import grad_scalers, load_scaler_state, scaler_state
from verl_hpc.models.moe import expert_offset, split_local_expert

FORMAT = "verl_hpc.megatron_engine/1"
FSDP_FORMAT = "verl_hpc.fsdp_engine/1"  # read too: its Megatron-coordinate states
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Local rows [lo, hi) of a parameter = logical tensor `name` at `offsets` (for row lo)."""

    name: str
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    lo: int
    hi: int


def _logical_name(gpt, local: str, expert_offset: int = 0) -> str:
    m = _LAYER.match(local)
    if m:
        j, rest = int(m.group(1)), m.group(2)
        rest = TE_NAMES.get(rest, rest)
        expert = split_local_expert(rest)
        if expert is not None:
            rest = f"mlp.experts.{expert_offset + expert[0]}.{expert[1]}"
        return f"decoder.layers.{gpt.decoder.layers[j].layer_number - 1}.{rest}"
    return local


def param_pieces(gpt, local: str, param: torch.Tensor, tp_rank: int, tp: int,
                 value_head: bool, expert_offset: int = 0) -> Tuple[List[Piece], bool]:
    """(pieces, saved): saved is False for a load-only target (the tied output-layer copy).
    For a routed expert's parameter, tp_rank / tp are the expert-TP place and `expert_offset` the
    global index of this rank's first expert."""
    shape = tuple(param.shape)
    arch = gpt.verl_arch
    if local == "output_layer.weight" and value_head:
        return [Piece("value_head.weight", shape, (0,) * len(shape), 0, shape[0])], True
    if local == "output_layer.weight" and arch.tie_word_embeddings:
        local, saved = "embedding.word_embeddings.weight", False
    else:
        saved = True
    name = _logical_name(gpt, local, expert_offset)
    if local in ("embedding.word_embeddings.weight", "output_layer.weight"):
        per, real = shape[0], arch.vocab_size
        start = tp_rank * per
        hi = max(0, min(per, real - start))
        return [Piece(name, (real,) + shape[1:], (start,) + (0,) * (len(shape) - 1), 0, hi)], saved
    if name.endswith(("linear_fc1.weight", "mlp.linear_fc1.lora_B")) and gpt.config.gated_linear_unit:
        f = shape[0] // 2
        glob = (f * tp,) + shape[1:]
        off = (tp_rank * f,) + (0,) * (len(shape) - 1)
        return [Piece(f"{name}/gate", glob, off, 0, f), Piece(f"{name}/up", glob, off, f, 2 * f)], saved
    glob, off = list(shape), [0] * len(shape)
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        d = param.partition_dim
        glob[d], off[d] = shape[d] * tp, tp_rank * shape[d]
    return [Piece(name, tuple(glob), tuple(off), 0, shape[0] if shape else 1)], saved


def _box_slabs(prefix: str, pieces: Sequence[Piece], tensor: torch.Tensor,
               box_off: Sequence[int]) -> Iterator[Any]:
    """ShardedTensors for a local box `tensor` whose first element sits at local `box_off`."""
    if tensor.dim() == 0:
        raise ValueError("0-d parameters are not expected in a Megatron GPT model")
    r0b, r1b = box_off[0], box_off[0] + tensor.shape[0]
    for pc in pieces:
        r0, r1 = max(r0b, pc.lo), min(r1b, pc.hi)
        if r0 >= r1:
            continue
        offsets = [pc.offsets[0] + r0 - pc.lo] + [pc.offsets[d] + box_off[d]
                                                  for d in range(1, tensor.dim())]
        yield ShardedTensor(f"{prefix}/{pc.name}", tensor[r0 - r0b: r1 - r0b], pc.global_shape,
                            offsets)


def _flat_slabs(prefix: str, pieces, flat: torch.Tensor, shape, start: int, stop: int):
    """Slabs of a flat element range [start, stop) of a parameter of local `shape`."""
    for fs, fe, off, box in flat_range_slabs(shape, start, stop):
        yield from _box_slabs(prefix, pieces, flat[fs - start: fe - start].view(box), off)


EXPERT_BIAS = ".mlp.router.expert_bias"


def _named_params(engine) -> Iterator[Tuple[Any, str, torch.nn.Parameter, Optional[Any]]]:
    """The parameters the state holds: all of them (and the routers' expert-bias buffers, which
    move every step), or under LoRA the adapters only (the frozen base is named in the meta by path
    and fingerprint and comes from the model folder)."""
    lora = getattr(engine, "lora", None) is not None
    for gpt, head in zip(engine.gpt_chunks, engine.heads):
        for local, p in gpt.named_parameters():
            if not lora or p.requires_grad:
                yield gpt, local, p, head
        if not lora:  # a sigmoid router's per-expert bias: trained by its own rule, a buffer (models/deepseek.py)
            for local, b in gpt.named_buffers():
                if local.endswith(EXPERT_BIAS):
                    yield gpt, local, b, head


def _pieces_by_param(engine) -> Dict[int, Tuple[List[Piece], bool]]:
    from megatron.core import parallel_state as ps

    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    etp_rank, etp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    out = {}
    for gpt, local, p, head in _named_params(engine):
        m = _LAYER.match(local)
        if m and split_local_expert(m.group(2)) is not None:
            offset = expert_offset(gpt.verl_arch.moe, ps.get_expert_model_parallel_rank(),
                                   ps.get_expert_model_parallel_world_size())
            out[id(p)] = param_pieces(gpt, local, p, etp_rank, etp, value_head=head is not None,
                                      expert_offset=offset)
        else:
            out[id(p)] = param_pieces(gpt, local, p, tp_rank, tp, value_head=head is not None)
    return out


# ----------------------------------------------------------------------------- optimizer states


def ensure_optimizer_state(optimizer) -> None:
    """Create Adam's moments (zeros, step 0) where the inner optimizer has not stepped yet."""
    for opt in optimizer.chained_optimizers:
        inner = opt.optimizer
        if inner is None:
            continue
        if any(len(inner.state[p]) == 0 for g in inner.param_groups for p in g["params"]):
            if getattr(opt, "init_state_fn", None) is not None:
                opt.init_state_fn(inner, opt.config)
            if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                for g in inner.param_groups:
                    for p in g["params"]:
                        inner.state[p].setdefault("step", adam_step_tensor(g, p))


def adam_step_tensor(group: dict, param: torch.Tensor) -> torch.Tensor:
    """A zero step count where torch's Adam(W) itself would create it: on the parameter's device for
    the fused and capturable kernels (the CUDA fused kernel refuses a CPU step: pytorch issue
    124133), on the CPU for the others."""
    on_param = group.get("fused") or group.get("capturable")
    return torch.zeros((), dtype=torch.float32, device=param.device if on_param else "cpu")


def _optimizer_entries(engine) -> Iterator[Tuple[torch.nn.Parameter, int, int, Dict[str, torch.Tensor]]]:
    """(model param, flat start, flat stop, {"main"?, "exp_avg", "exp_avg_sq"} flat tensors)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    keep_main = engine.dtype != torch.float32
    for opt in engine.optimizer.chained_optimizers:
        if isinstance(opt, DistributedOptimizer):
            for group in opt.model_float16_groups + opt.model_fp32_groups:
                for p in group:
                    rng = opt._get_model_param_range_map(p)["param"]
                    st = opt._get_main_param_and_optimizer_states(p)
                    t = {k: st[k].view(-1) for k in ("exp_avg", "exp_avg_sq")}
                    if keep_main:
                        t["main"] = st["param"].view(-1)
                    yield p, rng.start, rng.end, t
            continue
        if isinstance(opt, Float16OptimizerWithFloat16Params):
            pairs = [(p, m) for mg, g in zip(opt.fp32_from_float16_groups, opt.float16_groups)
                     for p, m in zip(g, mg)]
            pairs += [(p, p) for g in opt.fp32_from_fp32_groups for p in g]
        else:  # FP32Optimizer: the model parameters are the optimizer's
            pairs = [(p, p) for g in opt.optimizer.param_groups for p in g["params"]]
        for p, main in pairs:
            st = opt.optimizer.state[main]
            t = {k: st[k].view(-1) for k in ("exp_avg", "exp_avg_sq")}
            if keep_main:
                t["main"] = main.data.view(-1)
            yield p, 0, p.numel(), t


# Adam's step count lives in one of two places. torch.optim.Adam(W) (Megatron's choice on CPU) keeps
# it per parameter in `state[p]["step"]`; the fused Adams Megatron picks on GPU (Transformer Engine's
# FusedAdam, apex's) keep ONE count per group in `param_groups[i]["step"]`, created by their first
# step(). A resume must restore whichever the optimizer uses, or bias correction restarts at 1.
def _inner_optimizers(optimizer):
    return [o.optimizer for o in optimizer.chained_optimizers if o.optimizer is not None]


def optimizer_step_count(optimizer) -> int:
    """Adam's step count of a (chained) Megatron optimizer, from either layout; 0 before any step."""
    for inner in _inner_optimizers(optimizer):
        for g in inner.param_groups:
            if "step" in g:  # fused layout
                return int(g["step"])
            for p in g["params"]:
                if "step" in inner.state.get(p, {}):
                    return int(inner.state[p]["step"])
    return 0


def set_optimizer_step_count(optimizer, step: int) -> None:
    """Restore the count where this optimizer keeps it (run ensure_optimizer_state first: a fresh
    per-parameter optimizer then has `state[p]["step"]`, a fused one has no step anywhere)."""
    for inner in _inner_optimizers(optimizer):
        for g in inner.param_groups:
            per_param = [inner.state[p] for p in g["params"] if "step" in inner.state.get(p, {})]
            for st in per_param:
                st["step"] = torch.as_tensor(float(step), dtype=st["step"].dtype,
                                             device=st["step"].device)
            if per_param or (step == 0 and "step" not in g):
                continue
            if torch.is_tensor(g.get("step")):  # a capturable fused Adam keeps a device tensor
                g["step"].fill_(step)
            else:
                g["step"] = int(step)


# ----------------------------------------------------------------------------- the contract


def _slabs(engine, for_load: bool) -> List[Any]:
    pieces = _pieces_by_param(engine)
    out = []
    for _, _, p, _ in _named_params(engine):
        ps_, saved = pieces[id(p)]
        if saved or for_load:
            out.extend(_box_slabs("model", ps_, p.data, (0,) * p.dim()))
    if engine.optimizer is not None:
        ensure_optimizer_state(engine.optimizer)
        for p, start, stop, tensors in _optimizer_entries(engine):
            ps_, saved = pieces[id(p)]
            if not (saved or for_load):
                continue
            for key, flat in tensors.items():
                out.extend(_flat_slabs(f"optim/{key}", ps_, flat, tuple(p.shape), start, stop))
    return out


def engine_state(engine):
    meta: Dict[str, Any] = {"format": FORMAT, "head": engine.options.head,
                            "dtype": engine.options.dtype, "steps_applied": engine.steps_applied}
    tensors = _slabs(engine, for_load=False)
    if getattr(engine, "lora", None) is not None:
        meta["lora"] = lora_state_meta(engine.lora, engine.options.model_path)
    if engine.optimizer is not None:
        meta["optimizer_step"] = optimizer_step_count(engine.optimizer)
        meta["scheduler"] = engine.scheduler.state_dict()
        scalers = grad_scalers(engine.optimizer)  # fp16; kept equal by guarded_step: the first
        if scalers:
            meta["grad_scaler"] = scaler_state(scalers[0])
    return EngineState(tensors=tensors, meta=meta)


def _check_meta(engine, meta: Mapping[str, Any]) -> bool:
    """Whether the state is the FSDP engine's (in Megatron's coordinates); raises a
    CheckpointLayoutError naming what does not fit."""
    fmt = meta.get("format")
    if fmt == FSDP_FORMAT:
        arch = meta.get("architecture") or "the model"
        if meta.get("coords") != "megatron":
            raise CheckpointLayoutError(
                f"the FSDP engine's checkpoint of {arch} names its tensors in {meta.get('coords')!r} "
                "coordinates: this architecture is not in Megatron's coordinates (only the Llama, Qwen2 "
                "and Mistral families map); resume it with parallel.engine=fsdp")
        mine = engine.gpt_chunks[0].verl_arch  # family llama, architecture LlamaForCausalLM
        if str(meta.get("architecture", mine.family)).lower() != mine.family:
            raise CheckpointLayoutError(f"the checkpoint's model is {arch}, model.path's is {mine.architecture}: "
                                        "resume with the model it was trained on")
        if meta.get("lora") is not None:
            raise CheckpointLayoutError(
                "the FSDP engine's LoRA checkpoint holds PEFT's adapter factors (one A per q/k/v module), "
                "not the Megatron engine's fused ones; resume it with parallel.engine=fsdp")
    elif fmt != FORMAT:
        raise CheckpointLayoutError(f"engine state format {fmt!r}; this engine reads {FORMAT} and {FSDP_FORMAT}")
    if meta.get("head") != engine.options.head:
        raise CheckpointLayoutError(f"engine state is of a {meta.get('head')!r} head; this engine has "
                                    f"{engine.options.head!r}")
    return fmt == FSDP_FORMAT


def _masters_from_fp32_model(slabs: Sequence[Any]) -> Tuple[List[Any], List[Tuple[torch.Tensor, torch.Tensor]]]:
    """The FSDP engine keeps fp32 weights only (its `model/` tensors are the master weights): a
    bf16/fp16 Megatron engine fills its fp32 masters (optim/main) from them, exactly, and its
    model parameters from the same tensors through an fp32 buffer, cast after the load.
    Returns (slabs to load, [(parameter slab, its fp32 buffer)])."""
    out, casts = [], []
    for s in slabs:
        if s.name.startswith("optim/main/"):
            out.append(dataclasses.replace(s, name="model/" + s.name[len("optim/main/"):]))
        elif s.name.startswith("model/") and s.local.dtype != torch.float32:
            buf = torch.empty(s.local.shape, dtype=torch.float32, device=s.local.device)
            out.append(dataclasses.replace(s, local=buf))
            casts.append((s.local, buf))
        else:
            out.append(s)
    return out, casts


def load_engine_state(engine, load_into: Callable[[Sequence[Any]], None], meta: Mapping[str, Any]) -> None:
    """This engine's own state, or the FSDP engine's in Megatron's coordinates (the same names,
    shapes and meta keys: verl_hpc/engines/fsdp/state.py). Refuses (one line, nothing changed)
    another format, head, adapters or model (state_check.py)."""
    from_fsdp = _check_meta(engine, meta)
    check_lora_meta(meta.get("lora"), getattr(engine, "lora", None), engine.options.model_path)
    slabs = _slabs(engine, for_load=True)
    check_same_model(load_into, model_shapes(slabs), f"model.path ({engine.gpt_chunks[0].verl_arch.architecture})")
    casts: List[Tuple[torch.Tensor, torch.Tensor]] = []
    if from_fsdp and engine.dtype != torch.float32:
        slabs, casts = _masters_from_fp32_model(slabs)
    with torch.no_grad():
        load_into(slabs)
        for dst, buf in casts:
            dst.copy_(buf)
    engine.steps_applied = int(meta.get("steps_applied", 0))
    if engine.optimizer is None:
        return
    set_optimizer_step_count(engine.optimizer, int(meta.get("optimizer_step", 0)))
    if "scheduler" in meta:
        engine.scheduler.load_state_dict(dict(meta["scheduler"]))
    # fp16: the loss scale and its trackers, exactly (a state without one, e.g. a bf16 run's,
    # leaves the fresh scaler at optim.initial_loss_scale)
    if "grad_scaler" in meta:
        for scaler in grad_scalers(engine.optimizer):
            load_scaler_state(scaler, meta["grad_scaler"])
