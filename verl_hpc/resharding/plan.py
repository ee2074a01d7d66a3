"""The sliced sync's plan: which training rank sends which slice of which HF tensor to which
rollout rank, computed once from both layouts.

    plan = SyncPlan.build(me, order, shapes, holdings, needs, element_size=2, bucket_bytes=b)
    plan.buckets[k]        # indices into plan.order: the same on every rank
    plan.transfers[k]      # this rank's Transfers (sent or received) in bucket k
    plan.needs[hf]         # the part of `hf` this rank's rollout engine keeps

Training side (`Holding`): what each training rank holds of each HF tensor, in HF coordinates,
without any gather: Megatron's shards are contiguous ranges along one dim of each HF tensor
(verl_hpc.models.weight_rules, `pieces`): QKV's whole query groups become a row range of each of
q_proj, k_proj and v_proj; fc1's `[gate; up]` a row range of each of gate_proj and up_proj;
row-parallel weights a column range; the embedding and output layer a range of real vocabulary
rows (Megatron's padding rows are not HF rows and are never sent); norms the whole tensor on
every TP rank. Pipeline stages and virtual chunks hold disjoint tensors; data-parallel replicas
hold identical copies.

Rollout side (`RolloutSlicer`): which part of each HF tensor an inference-TP rank keeps, as vLLM's
weight loaders cut it: column-parallel weights (q/k/v and their biases, gate/up) a row range,
k/v whole heads replicated when there are fewer KV heads than inference ranks, row-parallel
weights (o_proj, down_proj) a column range, the embedding and lm_head a range of the vocabulary
padded to 64 rows and split evenly (the padding again never sent), norms whole. The vocabulary tensors
are the model's own (found through its get_input_embeddings / get_output_embeddings, models/
vocab_tensors.py), not Llama's names: GPT-NeoX's gpt_neox.embed_in, Falcon's transformer.word_embeddings.

A need is covered by cutting it at every holder boundary and taking each segment from the best
holder: the receiver itself (no wire), else a holder in the receiver's own training replica (a
data-parallel replica sits on the fewest nodes), else the lowest rank. So a rollout rank receives
exactly its slices, once, from the ranks that hold them; no rank receives a full tensor it does
not keep.

Buckets: the tensors in one global order, cut where the full tensors' bytes would pass the
bucket size; the same on every rank, so every bucket is one collective exchange.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from verl_hpc.errors import VerlHpcError
from verl_hpc.models.vocab_tensors import LLAMA as LLAMA_VOCAB  # (models/vocab_tensors.py finds a model's own)

log = logging.getLogger(__name__)

VLLM_VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before its TP split


class PlanError(VerlHpcError, ValueError):
    """The two layouts cannot be matched slice by slice: resharding.mode=auto falls back to the
    full-tensor path, resharding.mode=sliced stops with this."""

    exit_code, kind = 27, "sync plan"


@dataclasses.dataclass(frozen=True)
class Holding:
    """Training rank `rank` holds `hf[start:stop]` along `dim` (dim None: the whole tensor)."""

    rank: int
    hf: str
    dim: Optional[int]
    start: int
    stop: int
    dp_rank: int = 0


@dataclasses.dataclass(frozen=True)
class Need:
    """Rollout rank `rank` keeps `hf[start:stop]` along `dim` (a whole 1-D tensor is dim 0, all)."""

    rank: int
    hf: str
    dim: int
    start: int
    stop: int
    dp_rank: int = 0  # the training replica this rank belongs to (where it prefers its sources)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """`src` sends `dst` the part `hf[start:stop]` along `dim`."""

    hf: str
    src: int
    dst: int
    dim: int
    start: int
    stop: int


def _div(n: int, k: int, what: str) -> int:
    if n % k:
        raise PlanError(f"{what} = {n} does not split over inference TP {k}")
    return n // k


class RolloutSlicer:
    """The part of each HF tensor that inference-TP rank `tp_rank` of `tp` keeps (vLLM's cut)."""

    # dense MLPs, Qwen2-MoE's shared expert and every routed expert (vLLM's FusedMoE cuts each
    # expert like a dense MLP: gate/up rows, down columns; Mixtral names them w1/w3 and w2)
    # DeepSeek-V3's latent attention: q_b_proj / kv_b_proj split by heads (rows), like q_proj
    COLUMN = re.compile(r"\.(self_attn\.([qkv]|q_b|kv_b)_proj|(gate|up)_proj|experts\.\d+\.w[13])\.(weight|bias)$")
    ROW = re.compile(r"\.(self_attn\.o_proj|down_proj|experts\.\d+\.w2)\.weight$")
    # MoE routers and Qwen2-MoE's shared-expert gate: small, replicated on every inference rank
    # and DeepSeek-V3's latent down-projections (vLLM's ReplicatedLinear: the latents are small)
    REPLICATED = re.compile(r"\.(mlp\.gate|block_sparse_moe\.gate|mlp\.shared_expert_gate|"
                            r"self_attn\.q_a_proj|self_attn\.kv_a_proj_with_mqa)\.weight$")

    def __init__(self, tp: int, *, head_dim: int, vocab_size: int, vocab: Sequence[str] = LLAMA_VOCAB):
        """vocab: the names of the model's vocabulary tensors (input embedding, output layer), from
        its own accessors (models/vocab_tensors.py); Llama's by default."""
        self.tp, self.head_dim, self.vocab_size = tp, head_dim, vocab_size
        self.vocab = frozenset(vocab)

    def need(self, hf: str, shape: Sequence[int], tp_rank: int) -> Tuple[int, int, int]:
        """(dim, start, stop) of `hf` (full shape `shape`) kept by `tp_rank`."""
        tp = self.tp
        if tp == 1:
            return 0, 0, shape[0]
        if hf in self.vocab:
            per = -(-self.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            per = _div(per, tp, f"{hf}: the padded vocabulary")
            return 0, min(tp_rank * per, shape[0]), min((tp_rank + 1) * per, shape[0])
        if self.ROW.search(hf):
            per = _div(shape[1], tp, f"{hf}: columns")
            return 1, tp_rank * per, (tp_rank + 1) * per
        if self.COLUMN.search(hf):
            if re.search(r"\.[kv]_proj\.", hf):
                heads = shape[0] // self.head_dim
                if heads < tp:  # vLLM replicates whole KV heads: tp / heads ranks share one
                    shard = tp_rank // _div(tp, heads, f"{hf}: inference TP over {heads} KV heads")
                    return 0, shard * self.head_dim, (shard + 1) * self.head_dim
            per = _div(shape[0], tp, f"{hf}: rows")
            return 0, tp_rank * per, (tp_rank + 1) * per
        if len(shape) == 1 or self.REPLICATED.search(hf):  # norms, routers: on every inference rank
            return 0, 0, shape[0]
        raise PlanError(f"{hf}: no rule for how the rollout engine splits it at TP {tp}")


@dataclasses.dataclass
class SyncPlan:
    """This rank's part of the plan, bucket by bucket.

    order: every HF tensor in the global order; shapes: their full shapes;
    buckets: lists of indices into `order`; transfers: every transfer this rank sends or receives
    (both, when it sends to itself), in (tensor, dst, start) order.
    """

    rank: int
    order: List[str]
    shapes: Dict[str, Tuple[int, ...]]
    needs: Dict[str, Need]  # this rank's own
    buckets: List[List[int]]
    transfers: Dict[int, List[Transfer]]  # bucket -> this rank's transfers in it

    @classmethod
    def build(cls, rank: int, order: Sequence[str], shapes: Dict[str, Tuple[int, ...]],
              holdings: Iterable[Holding], needs: Iterable[Need], *, element_size: int,
              bucket_bytes: int) -> "SyncPlan":
        by_tensor: Dict[str, List[Holding]] = {}
        for h in holdings:
            by_tensor.setdefault(h.hf, []).append(h)
        need_by_tensor: Dict[str, List[Need]] = {}
        for n in needs:
            need_by_tensor.setdefault(n.hf, []).append(n)
        missing = [hf for hf in order if hf not in by_tensor]
        if missing:
            raise PlanError(f"no training rank holds {missing[:3]} ({len(missing)} tensors)")
        buckets = _buckets(order, shapes, element_size, bucket_bytes)
        transfers: Dict[int, List[Transfer]] = {}
        mine: Dict[str, Need] = {}
        for b, members in enumerate(buckets):
            rows = transfers.setdefault(b, [])
            for i in members:
                hf = order[i]
                for need in sorted(need_by_tensor.get(hf, []), key=lambda n: n.rank):
                    if need.rank == rank:
                        mine[hf] = need
                    for t in _cover(need, by_tensor[hf], shapes[hf]):
                        if rank in (t.src, t.dst):
                            rows.append(t)
        return cls(rank, list(order), dict(shapes), mine, buckets, transfers)

    def received_elements(self) -> int:
        """Elements of the HF tensors this rank keeps (what it receives per dense sync)."""
        return sum(_elements(self.shapes[hf], n.dim, n.stop - n.start) for hf, n in self.needs.items())


def _elements(shape: Sequence[int], dim: int, length: int) -> int:
    n = length
    for d, size in enumerate(shape):
        if d != dim:
            n *= size
    return n


def _buckets(order, shapes, element_size: int, bucket_bytes: int) -> List[List[int]]:
    out: List[List[int]] = []
    current, used = [], 0
    for i, hf in enumerate(order):
        size = _elements(shapes[hf], 0, shapes[hf][0]) * element_size
        if current and used + size > bucket_bytes:
            out.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        out.append(current)
    return out


def _whole(dim, start, stop, shape) -> bool:
    return dim is None or (start == 0 and stop == shape[dim])


def _cover(need: Need, holders: List[Holding], shape: Sequence[int]) -> List[Transfer]:
    """The need cut at every holder boundary, each segment from its best holder, merged.

    A whole tensor is whole along any dim: a rank keeping all of it takes it along the dim the
    training shards split (o_proj from two column halves), a holder of all of it serves any range.
    """
    split_dims = {h.dim for h in holders if not _whole(h.dim, h.start, h.stop, shape)}
    if len(split_dims) > 1:
        raise PlanError(f"{need.hf}: training shards split it along dims {sorted(split_dims)}")
    dim, start, stop = need.dim, need.start, need.stop
    if _whole(dim, start, stop, shape) and split_dims:
        dim = split_dims.pop()
        start, stop = 0, shape[dim]
    spans = []
    for h in holders:
        if _whole(h.dim, h.start, h.stop, shape):
            spans.append((h, 0, shape[dim]))
        elif h.dim == dim and h.start < stop and h.stop > start:
            spans.append((h, h.start, h.stop))
    cuts = sorted({start, stop} | {x for _, a, b in spans for x in (a, b) if start < x < stop})

    def preference(h: Holding):  # lower is better
        return (h.rank != need.rank, h.dp_rank != need.dp_rank, h.rank)

    out: List[Transfer] = []
    for lo, hi in zip(cuts, cuts[1:]):
        covering = [h for h, a, b in spans if a <= lo and b >= hi]
        if not covering:
            raise PlanError(f"{need.hf}[{lo}:{hi}] along dim {dim} is held by no training rank")
        src = min(covering, key=preference).rank
        if out and out[-1].src == src and out[-1].stop == lo:
            out[-1] = dataclasses.replace(out[-1], stop=hi)
        else:
            out.append(Transfer(need.hf, src, need.rank, dim, lo, hi))
    return out


def rollout_slicer(mode: str, model_path: str, rollout_tp: int) -> Optional[RolloutSlicer]:
    """What each rollout rank keeps of a model folder's tensors, for split placement's publisher and the
    served-weights check (mode: resharding.mode, sliced or auto); None: every rollout rank takes
    every full tensor (resharding.mode full, or an engine that cuts by the model's own plan).
    model_path: model.path; rollout_tp: rollout.tp."""
    if mode == "full":
        return None
    from verl_hpc.rollout.vllm import transformers_backend as vllm_transformers

    if rollout_tp > 1 and vllm_transformers.choose_impl(model_path) is not None:  # the engine's own choice
        if mode == "sliced":
            raise PlanError(f"resharding.mode=sliced: {vllm_transformers.SLICED_WHY}; use resharding.mode=auto or full")
        log.warning("weight sync: every rollout rank takes the full tensors (%s)", vllm_transformers.SLICED_WHY)
        return None
    from verl_hpc.models.vocab_tensors import folder_geometry, folder_vocab_names

    head_dim, vocab_size = folder_geometry(model_path)  # any family, not only the Megatron-mapped ones
    return RolloutSlicer(rollout_tp, head_dim=head_dim, vocab_size=vocab_size, vocab=folder_vocab_names(model_path))
