"""The kinds of HF <-> Megatron tensor rule (one class per way a Megatron parameter maps onto HF
tensors), for Llama-style decoders; the per-family tables of which parameter follows which rule, and
their lookup, are verl_hpc.models.weight_rules.

Each rule knows, for one Megatron parameter of one layer:
- `load(reader, arch, layer, lay)`: this TP rank's shard (`lay: Layout`), read as slices of the
  HF tensors;
- `to_hf(full, arch, layer, lay)`: the HF tensors from the TP-gathered Megatron tensor (shards
  concatenated along `tp_dim` in rank order);
- `hf_entries(arch, layer)`: the HF names and shapes it produces (export plans without any tensor);
- `pieces(local, arch, layer, lay)`: what this TP rank's own shard is in HF coordinates, without
  any gather: `Piece`s (HF name, split dim, first index, tensor view). Every shard of these layouts
  is, per HF tensor, one contiguous range along one dim (whole groups of QKV per rank, the rank's
  gate rows and up rows, a range of columns, a range of vocabulary rows), which is what lets the
  sliced weight sync (verl_hpc.resharding.plan) send a rollout rank only its part.

Megatron layouts (docs/platform-notes.md, "megatron-core 0.16.1 on CPU"; verified for parity with
transformers):
- linear_qkv: per query group g, that group's q heads, then its k head, then its v head, along
  dim 0; TP rank r holds groups [r*G/tp, (r+1)*G/tp), which are contiguous in that layout.
- linear_fc1: TP rank r holds [gate rows of r; up rows of r]; gathered, the shards interleave.
- linear_proj / linear_fc2 split dim 1 (row-parallel); embedding / output layer split dim 0 of
  the padded vocabulary, whose padded rows are zero on load and dropped on export.
- MoE layers (models/moe.py): the router is replicated; routed expert e's linear_fc1 / linear_fc2
  follow the dense rules over the *expert* tensor-parallel group (`group = "etp"`), and only the
  ranks of e's expert-parallel rank hold it (weight_rules.rule_for binds the global expert index); the shared
  expert follows the dense rules over the TP group.
- DeepSeek-V3's latent attention (weight_rules.MLA_RULES): each projection is a column-parallel linear whose
  rows (per-head blocks for q/q_b and kv_b) are split over TP as they stand in the HF tensor
  (`Rows`); o_proj splits its columns; the router's per-expert bias (a buffer) is replicated.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from verl_hpc.models.config_mapping import ModelArch
from verl_hpc.models.moe import expert_offset, hf_expert_names, hf_router_name, hf_shared_expert_prefix

HFTensors = List[Tuple[str, torch.Tensor]]
LAYER = "model.layers.{i}."


def _rows(start: int, stop: int) -> Tuple[slice, ...]:
    return (slice(start, stop),)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a shard sits: this TP rank of `tp`, and the padded vocabulary of the model; for MoE
    models this rank's expert-parallel and expert-tensor-parallel places."""

    tp_rank: int
    tp: int
    padded_vocab: int
    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1

    def for_group(self, group: str) -> "Layout":
        """The layout a rule of `group` ("tp" or "etp") sees as its tensor-parallel place."""
        if group == "etp":
            return dataclasses.replace(self, tp_rank=self.etp_rank, tp=self.etp)
        return self

    def expert_offset(self, arch: ModelArch) -> int:
        """The global index of this rank's first routed expert."""
        return expert_offset(arch.moe, self.ep_rank, self.ep)


def _dims(arch: ModelArch, what: str) -> int:
    """Sizes a rule's HF shapes are made of."""
    mla = arch.mla
    if mla is not None and what in _MLA_DIMS:
        return _MLA_DIMS[what](mla, arch.num_attention_heads)
    return {"hidden": arch.hidden_size, "head": arch.head_dim, "ffn": arch.ffn_hidden_size,
            "proj": arch.num_attention_heads * arch.head_dim,
            "experts": arch.moe.num_experts if arch.moe else 0,
            "expert_ffn": arch.moe.expert_ffn if arch.moe else 0,
            "shared_ffn": arch.moe.shared_ffn if arch.moe else 0, "one": 1}[what]


# multi-head latent attention (DeepSeek-V3, models/deepseek.py): sizes from its MLAArch and the head count
_MLA_DIMS = {
    "proj": lambda m, n: n * m.v_head_dim,  # o_proj's input
    "q_proj": lambda m, n: n * m.qk_head_dim,  # q_proj / q_b_proj rows: per head [nope; rope]
    "q_lora": lambda m, n: m.q_lora_rank,
    "kv_a": lambda m, n: m.kv_lora_rank + m.qk_rope_head_dim,  # kv_a_proj_with_mqa: [latent; rope key]
    "kv_lora": lambda m, n: m.kv_lora_rank,
    "kv_b": lambda m, n: n * (m.qk_nope_head_dim + m.v_head_dim),  # per head [k_nope; v]
}


def _hf_name(template: str, arch: ModelArch, layer: Optional[int], expert: Optional[int]) -> str:
    """A rule's HF name: "{router}" / "{expert:gate|up|down}" / "{shared}..." resolve by family first."""
    if template.startswith("{shared}"):
        template = hf_shared_expert_prefix(arch.family) + template[len("{shared}"):]
    if template == "{router}":
        template = hf_router_name(arch.family)
    elif template.startswith("{expert:"):
        template = hf_expert_names(arch.family)[template[len("{expert:"):-1]]
    return template.format(i=layer, e=expert)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of an HF tensor held locally: `tensor` is `hf[start:start + len]` along `dim` (the
    whole tensor when `dim` is None, replicated on every TP rank)."""

    hf: str
    dim: Optional[int]
    start: int
    tensor: torch.Tensor

    @property
    def stop(self) -> int:
        return self.start + (self.tensor.shape[self.dim] if self.dim is not None else 0)


@dataclasses.dataclass(frozen=True)
class Copy:
    """Replicated on every TP rank (norm weights; an MoE router, Qwen2-MoE's shared-expert gate).
    `shape`: the HF tensor's dims, by name (see _dims)."""

    hf: str
    tp_dim: Optional[int] = None
    shape: Tuple[str, ...] = ("hidden",)
    group: str = "tp"
    expert: Optional[int] = None

    def _name(self, arch, layer):
        return _hf_name(self.hf, arch, layer, self.expert)

    def hf_entries(self, arch: ModelArch, layer: Optional[int]):
        return [(self._name(arch, layer), tuple(_dims(arch, d) for d in self.shape))]

    def load(self, reader, arch, layer, lay) -> torch.Tensor:
        return reader.read(self._name(arch, layer))

    def to_hf(self, full, arch, layer, lay) -> HFTensors:
        return [(self._name(arch, layer), full)]

    def pieces(self, local, arch, layer, lay) -> List[Piece]:
        return [Piece(self._name(arch, layer), None, 0, local)]


@dataclasses.dataclass(frozen=True)
class Split:
    """Row-parallel linear: the HF weight split along `tp_dim` (1 = input features).
    `shape`: its input features, by name ("proj": heads * head_dim; "ffn", "expert_ffn", "shared_ffn")."""

    hf: str
    shape: str
    tp_dim: int = 1
    group: str = "tp"
    expert: Optional[int] = None

    def _name(self, arch, layer):
        return _hf_name(self.hf, arch, layer, self.expert)

    def hf_entries(self, arch, layer):
        return [(self._name(arch, layer), (arch.hidden_size, _dims(arch, self.shape)))]

    def load(self, reader, arch, layer, lay):
        name = self._name(arch, layer)
        size = reader.shape(name)[self.tp_dim] // lay.tp
        index = [slice(None)] * (self.tp_dim + 1)
        index[self.tp_dim] = slice(lay.tp_rank * size, (lay.tp_rank + 1) * size)
        return reader.read(name, tuple(index))

    def to_hf(self, full, arch, layer, lay):
        return [(self._name(arch, layer), full)]

    def pieces(self, local, arch, layer, lay):
        return [Piece(self._name(arch, layer), self.tp_dim, lay.tp_rank * local.shape[self.tp_dim], local)]


@dataclasses.dataclass(frozen=True)
class Rows:
    """Column-parallel linear without a fused layout: the HF weight [out, in] split along its rows
    (multi-head latent attention's projections; per-head row blocks stay whole on a TP rank)."""

    hf: str
    out: str  # its rows, by name (see _dims)
    inp: str  # its columns
    tp_dim: int = 0
    group: str = "tp"

    def hf_entries(self, arch, layer):
        return [(self.hf.format(i=layer), (_dims(arch, self.out), _dims(arch, self.inp)))]

    def load(self, reader, arch, layer, lay):
        rows = _dims(arch, self.out) // lay.tp
        return reader.read(self.hf.format(i=layer), _rows(lay.tp_rank * rows, (lay.tp_rank + 1) * rows))

    def to_hf(self, full, arch, layer, lay):
        return [(self.hf.format(i=layer), full)]

    def pieces(self, local, arch, layer, lay):
        return [Piece(self.hf.format(i=layer), 0, lay.tp_rank * local.shape[0], local)]


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Embedding or output layer: rows of the padded vocabulary, split along dim 0."""

    hf: str
    tp_dim: int = 0
    group: str = "tp"

    def hf_entries(self, arch, layer):
        return [(self.hf, (arch.vocab_size, arch.hidden_size))]

    def load(self, reader, arch, layer, lay):
        per_rank = lay.padded_vocab // lay.tp
        start, stop = lay.tp_rank * per_rank, (lay.tp_rank + 1) * per_rank
        out = torch.zeros(per_rank, arch.hidden_size, dtype=reader.dtype(self.hf))
        real_stop = min(stop, arch.vocab_size)
        if real_stop > start:  # a rank may hold only padding when the vocabulary is tiny
            out[: real_stop - start] = reader.read(self.hf, _rows(start, real_stop))
        return out

    def to_hf(self, full, arch, layer, lay):
        return [(self.hf, full[: arch.vocab_size])]

    def pieces(self, local, arch, layer, lay):
        start = lay.tp_rank * local.shape[0]
        real = min(start + local.shape[0], arch.vocab_size) - start  # padding rows are not HF's
        return [Piece(self.hf, 0, start, local[:real])] if real > 0 else []


@dataclasses.dataclass(frozen=True)
class QKV:
    """q_proj/k_proj/v_proj (weight or Qwen2's bias) <-> Megatron's fused linear_qkv."""

    part: str  # "weight" | "bias"
    tp_dim: int = 0
    group: str = "tp"

    def _names(self, layer):
        return [f"{LAYER}self_attn.{p}_proj.{self.part}".format(i=layer) for p in "qkv"]

    def hf_entries(self, arch, layer):
        q_rows = arch.num_attention_heads * arch.head_dim
        kv_rows = arch.num_query_groups * arch.head_dim
        tail = (arch.hidden_size,) if self.part == "weight" else ()
        return [(n, (rows,) + tail) for n, rows in zip(self._names(layer), (q_rows, kv_rows, kv_rows))]

    def load(self, reader, arch, layer, lay):
        groups = arch.num_query_groups // lay.tp
        g0, hd, hpg = lay.tp_rank * groups, arch.head_dim, arch.heads_per_group
        q_name, k_name, v_name = self._names(layer)
        q = reader.read(q_name, _rows(g0 * hpg * hd, (g0 + groups) * hpg * hd))
        k = reader.read(k_name, _rows(g0 * hd, (g0 + groups) * hd))
        v = reader.read(v_name, _rows(g0 * hd, (g0 + groups) * hd))
        tail = q.shape[1:]
        fused = torch.cat([q.reshape(groups, hpg * hd, *tail), k.reshape(groups, hd, *tail),
                           v.reshape(groups, hd, *tail)], dim=1)
        return fused.reshape(groups * (hpg + 2) * hd, *tail)

    def to_hf(self, full, arch, layer, lay):
        hd, hpg = arch.head_dim, arch.heads_per_group
        tail = full.shape[1:]
        grouped = full.reshape(arch.num_query_groups, (hpg + 2) * hd, *tail)
        q, k, v = grouped.split([hpg * hd, hd, hd], dim=1)
        return [(n, t.reshape(-1, *tail).contiguous())
                for n, t in zip(self._names(layer), (q, k, v))]

    def pieces(self, local, arch, layer, lay):
        hd, hpg = arch.head_dim, arch.heads_per_group
        groups, tail = arch.num_query_groups // lay.tp, local.shape[1:]
        g0 = lay.tp_rank * groups
        q, k, v = local.reshape(groups, (hpg + 2) * hd, *tail).split([hpg * hd, hd, hd], dim=1)
        return [Piece(n, 0, g0 * rows, t.reshape(-1, *tail))
                for n, t, rows in zip(self._names(layer), (q, k, v), (hpg * hd, hd, hd))]


@dataclasses.dataclass(frozen=True)
class GateUp:
    """gate_proj/up_proj <-> Megatron's linear_fc1 ([gate; up] per TP rank); an MoE layer's
    routed experts (over the expert-TP group) and shared expert have the same layout."""

    tp_dim: int = 0
    hf: Tuple[str, str] = (LAYER + "mlp.gate_proj.weight", LAYER + "mlp.up_proj.weight")
    ffn: str = "ffn"  # the intermediate size, by name (see _dims)
    group: str = "tp"
    expert: Optional[int] = None

    def _names(self, layer, arch=None):
        return [_hf_name(t, arch, layer, self.expert) for t in self.hf]

    def hf_entries(self, arch, layer):
        return [(n, (_dims(arch, self.ffn), arch.hidden_size)) for n in self._names(layer, arch)]

    def load(self, reader, arch, layer, lay):
        rows = _dims(arch, self.ffn) // lay.tp
        return torch.cat([reader.read(n, _rows(lay.tp_rank * rows, (lay.tp_rank + 1) * rows))
                          for n in self._names(layer, arch)], dim=0)

    def to_hf(self, full, arch, layer, lay):
        tail = full.shape[1:]  # (hidden,) for the weight, (r,) for a LoRA B factor (models/lora.py)
        ffn = _dims(arch, self.ffn)
        per_rank = full.reshape(lay.tp, 2, ffn // lay.tp, *tail)
        return [(n, per_rank[:, j].reshape(ffn, *tail).contiguous())
                for j, n in enumerate(self._names(layer, arch))]

    def pieces(self, local, arch, layer, lay):
        rows = local.shape[0] // 2
        return [Piece(n, 0, lay.tp_rank * rows, local[j * rows:(j + 1) * rows])
                for j, n in enumerate(self._names(layer, arch))]
