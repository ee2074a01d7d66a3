"""The FSDP engine's checkpoint state in the coordinates the Megatron engine writes, so that either
engine resumes the other (contract: verl_hpc/engines/base.py).

FSDP2 shards every parameter along dim 0: a rank holds rows [lo, hi) of each HF tensor (and its
Adam moments, sharded alike). Each such row range becomes slabs of the *logical* tensors:
- for an architecture mapped into Megatron (Llama, Qwen2, Mistral: `MEGATRON_NAMES`), the
  Megatron engine's names and shapes (verl_hpc/engines/megatron/state.py): q/k/v rows go to their
  place in the fused `linear_qkv` (per query group: its q heads, its k head, its v head), gate and
  up to `linear_fc1.weight/gate` and `/up`, norms, projections, embedding and output layer by
  name, a value head's `score.weight` to `value_head.weight`. A row range of q_proj crosses query
  groups, so it becomes one slab per group it touches; nothing is copied or gathered. Qwen2.5-VL's
  decoder (`model.language_model.*`) maps as Qwen2's, its vision tower (`model.visual.*`, transformers'
  module on both engines) is `visual.*` (its state of the HF names, written before, still loads).
- for any other architecture, the HF names themselves (`coords = "hf"` in the meta): such a
  checkpoint resumes in the FSDP engine at any world size, and the Megatron engine refuses it,
  saying why.
Optimizer moments: `optim/exp_avg/<name>`, `optim/exp_avg_sq/<name>`; the parameters are the
fp32 master weights (mixed precision is in compute only), so there is no `optim/main`. A Megatron
checkpoint of a bf16 model keeps its master weights there: the FSDP engine then loads them from
`optim/main` (exact) instead of the bf16 `model/` copy.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_hpc.checkpoint.errors import CheckpointLayoutError
from verl_hpc.checkpoint.sharded import ShardedTensor
from verl_hpc.engines.base import EngineState
from verl_hpc.engines.fsdp.optim import load_scaler_state, scaler_state
from verl_hpc.engines.state_check import check_same_model, model_shapes

FORMAT = "verl_hpc.fsdp_engine/1"
MEGATRON_FORMAT = "verl_hpc.megatron_engine/1"
# dense families both engines hold alike; Qwen2.5-VL's language model is Qwen2's, its tower is
# transformers' module on both engines (models/vlm.py), named `visual.*` in the checkpoint
MEGATRON_FAMILIES = ("llama", "qwen2", "mistral", "qwen2_5_vl")
VLM_FAMILIES = ("qwen2_5_vl",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_BY_NAME = {"input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
            "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
            "mlp.gate_proj.weight": "mlp.linear_fc1.weight/gate",
            "mlp.up_proj.weight": "mlp.linear_fc1.weight/up",
            "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
_TOP = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
        "lm_head.weight": "output_layer.weight", "score.weight": "value_head.weight"}


@dataclasses.dataclass(frozen=True)
class Slab:
    """Local rows [lo, hi) of a parameter = logical tensor `name` of `shape` at row `row`."""

    name: str
    shape: Tuple[int, ...]
    row: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class Coords:
    """How HF parameter names map to checkpoint names: `megatron` (with the fused-QKV geometry)
    or `hf` (names as they are)."""

    kind: str
    heads: int = 0
    groups: int = 0
    head_dim: int = 0
    vision: bool = False  # Qwen2.5-VL: its decoder under model.language_model, its tower under model.visual

    @classmethod
    def for_model(cls, hf_config: Mapping[str, Any]) -> "Coords":
        from verl_hpc.config.hf_model import MEGATRON_ARCHITECTURES as ARCHITECTURES

        archs = hf_config.get("architectures") or []
        family = ARCHITECTURES.get(archs[0]) if len(archs) == 1 else hf_config.get("model_type")
        if family not in MEGATRON_FAMILIES and hf_config.get("model_type") not in MEGATRON_FAMILIES:
            return cls("hf")
        vision = family in VLM_FAMILIES or hf_config.get("model_type") in VLM_FAMILIES
        text = (hf_config.get("text_config") or hf_config) if vision else hf_config
        heads = int(text["num_attention_heads"])
        groups = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        return cls("megatron", heads, groups, head_dim, vision)

    def slabs(self, hf: str, shape: Tuple[int, ...], lo: int, hi: int) -> List[Slab]:
        """The logical slabs of rows [lo, hi) of HF tensor `hf` (local rows counted from lo)."""
        if self.kind == "hf" or ".lora_" in hf:  # LoRA adapters: PEFT's names (engines/fsdp/lora.py)
            return [Slab(hf, shape, lo, 0, hi - lo)]
        if self.vision:  # the Megatron engine's names: the tower's as they are, the decoder's as a text model's
            if hf.startswith("model.visual."):
                return [Slab(hf[len("model."):], shape, lo, 0, hi - lo)]
            if hf.startswith("model.language_model."):
                hf = "model." + hf[len("model.language_model."):]
        if hf in _TOP:
            return [Slab(_TOP[hf], shape, lo, 0, hi - lo)]
        m = _LAYER.match(hf)
        if m is None:
            raise CheckpointLayoutError(f"{hf}: no Megatron name for this parameter of a Megatron-mapped model")
        layer, rest = int(m.group(1)), m.group(2)
        prefix = f"decoder.layers.{layer}."
        qkv = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", rest)
        if qkv is None:
            if rest not in _BY_NAME:
                raise CheckpointLayoutError(f"{hf}: no Megatron name for this parameter of a Megatron-mapped model")
            return [Slab(prefix + _BY_NAME[rest], shape, lo, 0, hi - lo)]
        which, part = qkv.groups()
        return self._qkv(prefix + f"self_attention.linear_qkv.{part}", which, shape, lo, hi)

    def _qkv(self, name: str, which: str, shape, lo: int, hi: int) -> List[Slab]:
        """Rows of q, k or v in Megatron's fused layout: group g's block is (q heads of g, k of g,
        v of g), each head `head_dim` rows."""
        d, per = self.head_dim, self.heads // self.groups
        block = (per + 2) * d
        fused = (self.groups * block,) + tuple(shape[1:])
        run = per * d if which == "q" else d  # rows of this tensor inside one group's block
        first = {"q": 0, "k": per * d, "v": (per + 1) * d}[which]
        out, r = [], lo
        while r < hi:
            g, within = divmod(r, run)
            stop = min(hi, (g + 1) * run)
            out.append(Slab(name, fused, g * block + first + within, r - lo, stop - lo))
            r = stop
        return out


def local_rows(param) -> Tuple[torch.Tensor, int]:
    """(this rank's local tensor of a parameter or moment, its first global row)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param.data, 0
    local = param.to_local()
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return local, (int(offset[0]) if offset else 0)


def _slabs_of(prefix: str, coords: Coords, hf: str, shape, tensor) -> Iterator[ShardedTensor]:
    local, row0 = local_rows(tensor)
    rows = local.shape[0] if local.dim() else 1
    if local.numel() == 0 and shape and shape[0] > 0:
        return  # this rank holds no rows of it (more ranks than rows)
    for s in coords.slabs(hf, tuple(shape), row0, row0 + rows):
        offsets = (s.row,) + (0,) * (len(s.shape) - 1)
        yield ShardedTensor(f"{prefix}/{s.name}", local[s.lo:s.hi], s.shape, offsets)


def _trained(engine) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """(HF name, parameter) of what the state holds: every parameter, or under LoRA the adapters."""
    for name, p in engine.hf_named_parameters():
        if engine.lora is None or p.requires_grad:
            yield name, p


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam's moments as zeros (step 0) where the optimizer has not stepped yet."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = _step_tensor(0.0, p)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _step_tensor(step: float, p: torch.Tensor) -> torch.Tensor:
    """Adam's step count as torch's fused AdamW keeps it (optim.py builds it fused): a float32
    scalar on the parameter's device; its kernel takes a param's state from one device."""
    return torch.tensor(float(step), dtype=torch.float32, device=p.device)


def _all_slabs(engine, main_from_optim: bool = False, coords: Optional[Coords] = None) -> List[ShardedTensor]:
    coords, out = coords or engine.coords, []
    params = list(_trained(engine))
    for hf, p in params:
        prefix = "optim/main" if main_from_optim else "model"
        out.extend(_slabs_of(prefix, coords, hf, p.shape, p))
    if engine.optimizer is not None:
        ensure_optimizer_state(engine.optimizer)
        for hf, p in params:
            if not p.requires_grad:  # frozen (a VLM's vision tower): no moments; its weights are above
                continue
            st = engine.optimizer.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                out.extend(_slabs_of(f"optim/{key}", coords, hf, p.shape, st[key]))
    return out


def optimizer_step_count(optimizer) -> int:
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            if "step" in st:
                return int(st["step"])
    return 0


def engine_state(engine) -> EngineState:
    meta: Dict[str, Any] = {"format": FORMAT, "coords": engine.coords.kind, "head": engine.options.head,
                            "dtype": engine.options.dtype, "steps_applied": engine.steps_applied,
                            "architecture": engine.architecture}
    if engine.lora is not None:
        meta["lora"] = engine.lora_meta()
    if engine.optimizer is not None:
        meta["optimizer_step"] = optimizer_step_count(engine.optimizer)
        meta["scheduler"] = engine.scheduler.state_dict()
        if engine.scaler is not None:  # fp16 compute: the Megatron engine's keys (optim.scaler_state)
            meta["grad_scaler"] = scaler_state(engine.scaler)
    return EngineState(tensors=_all_slabs(engine), meta=meta)


def check_meta(engine, meta: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's master weights are in optim/main (a Megatron bf16 state); raises
    a CheckpointLayoutError naming what does not fit."""
    fmt = meta.get("format")
    if fmt == MEGATRON_FORMAT:
        if engine.coords.kind != "megatron":
            raise CheckpointLayoutError(
                f"a Megatron engine's checkpoint cannot resume {engine.architecture} in the FSDP engine: "
                "only the architectures mapped into Megatron share its coordinates")
    elif fmt == FORMAT:
        if meta.get("architecture") not in (None, engine.architecture):
            raise CheckpointLayoutError(f"the checkpoint's model is {meta.get('architecture')}, model.path's "
                                        f"is {engine.architecture}: resume with the model it was trained on")
        if meta.get("coords") != engine.coords.kind and not _hf_vlm_state(engine, meta):
            raise CheckpointLayoutError(f"checkpoint in {meta.get('coords')!r} coordinates; this model "
                                        f"({engine.architecture}) is held in {engine.coords.kind!r} ones")
    else:
        raise CheckpointLayoutError(f"engine state format {fmt!r}; the FSDP engine reads {FORMAT} and "
                                    f"{MEGATRON_FORMAT}")
    if meta.get("head") != engine.options.head:
        raise CheckpointLayoutError(f"engine state is of a {meta.get('head')!r} head; this engine has "
                                    f"{engine.options.head!r}")
    return fmt == MEGATRON_FORMAT and meta.get("dtype", "float32") != "float32"


def _hf_vlm_state(engine, meta: Mapping[str, Any]) -> bool:
    """A Qwen2.5-VL state this engine wrote in HF names, before that family took Megatron's (it loads
    as it was written)."""
    return engine.coords.vision and meta.get("format") == FORMAT and meta.get("coords") == "hf"


def load_engine_state(engine, load_into: Callable[[Sequence[Any]], None], meta: Mapping[str, Any]) -> None:
    """Refuses (one line, nothing changed) a checkpoint of other coordinates, architecture, head,
    adapters or tensors (state_check.py); then fills the parameters and Adam's moments, the step
    count and the schedule."""
    main = check_meta(engine, meta)
    engine.check_lora_meta(meta.get("lora"))
    slabs = _all_slabs(engine, main_from_optim=main, coords=Coords("hf") if _hf_vlm_state(engine, meta) else None)
    check_same_model(load_into, model_shapes(slabs), f"model.path ({engine.architecture})")
    with torch.no_grad():
        load_into(slabs)
    engine.steps_applied = int(meta.get("steps_applied", 0))
    if engine.optimizer is None:
        return
    step = float(meta.get("optimizer_step", 0))
    for g in engine.optimizer.param_groups:
        for p in g["params"]:
            engine.optimizer.state[p]["step"] = _step_tensor(step, p)
    if "scheduler" in meta:
        engine.scheduler.load_state_dict(dict(meta["scheduler"]))
    if engine.scaler is not None and "grad_scaler" in meta:  # else a fresh scale (a bf16 run's state)
        load_scaler_state(engine.scaler, meta["grad_scaler"])
