"""The sliced (and optionally delta) weight sync: each rollout rank receives exactly its own slice
of each HF tensor, straight from the training ranks that hold it (verl_hpc.resharding.plan).

    sliced = SlicedSync(bucket_bytes, delta=True)
    for name, part, need in sliced.stream(model, keeps=(tp_rank, tp), dtype=torch.bfloat16):
        ...   # `part` is hf[need.start:need.stop] along need.dim, in `dtype`

Every rank of the default group calls `stream` at the same point (it is collective) and runs it
to its end. The plan is computed on the first call from every rank's holdings and needs (one
all_gather_object) and kept while the model and the rollout's layout stay the same.

Per bucket: the sends to each destination are packed into one byte buffer (one copy, casting to
the wire dtype) and exchanged with ONE `all_to_all_single` over the default group (gloo on CPU,
NCCL on GPUs), so a rank's wire traffic is its slices in and the slices it serves out. The
exchange of bucket k+1 is launched before bucket k is handed to the consumer, so it runs while
the consumer loads. A rank's own slices never enter the exchange (dense mode): they are views of
its parameters, cast where the rollout's dtype differs; a slice that arrives in one piece is used
where it landed.

Delta (`delta=True`): each sender keeps what it last sent per transfer, each receiver the slice
it last received (in the wire dtype: the rollout's). Elements whose bits did not change are not
sent (verl_hpc.resharding.delta picks dense, index or bitmap per transfer, never more than dense);
the receiver patches its copy and hands the whole slice on, since the rollout engine's loader
takes whole tensors. One extra small exchange per bucket carries each transfer's (mode, count,
checksum); the receiver checks its patched copy against the sender's checksum, so a copy that
drifted is an error, never a silent divergence. Under delta a rank's own slices go through the
codec too (counted and checked like the others, no wire). After a failed sync both sides drop
their copies: the next sync is dense. Memory: the sender's copies are the size of what it
serves, the receiver's the size of its slices, on the parameters' device.
"""
from __future__ import annotations

import logging
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from verl_hpc.resharding import delta as codec
from verl_hpc.resharding.plan import LLAMA_VOCAB, Holding, Need, PlanError, RolloutSlicer, SyncPlan, Transfer
from verl_hpc.runtime.device import collective_device

log = logging.getLogger(__name__)
Item = Tuple[str, torch.Tensor, Need]


class MegatronHoldings:
    """What this rank's Megatron model chunks hold of each HF tensor (verl_hpc.models.weights),
    for the plan. Any other source of local shards (the FSDP engine's `exported_model()`) yields an
    object with the same methods (vocab_names optional: Llama's names without it)."""

    def __init__(self, model):
        self.model = model

    def entries(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(HF name, full shape) of every tensor this rank's stage exports, in export order."""
        from verl_hpc.models.weights import stage_entries

        return stage_entries(self.model)

    def pieces(self):
        """Pieces (hf, dim, start, stop, tensor) of this rank's own parts, without a collective."""
        from verl_hpc.models.weights import local_hf_pieces

        return local_hf_pieces(self.model)

    def dp_rank(self) -> int:
        """The training replica this rank belongs to (where it prefers its sources)."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    def geometry(self) -> Tuple[int, int]:
        """(head_dim, vocabulary size): how the rollout's loaders cut heads and vocabulary rows."""
        from verl_hpc.models.weights import model_arch

        arch = model_arch(self.model)
        return arch.head_dim, arch.vocab_size

    def dtype(self) -> torch.dtype:
        from verl_hpc.models.weights import model_dtype

        return model_dtype(self.model)

    def vocab_names(self) -> Tuple[str, ...]:
        """The HF names of the vocabulary tensors (the family's embedding and output-layer rules)."""
        from verl_hpc.models.weight_rules import Vocab, model_rules
        from verl_hpc.models.weights import model_arch

        return tuple(r.hf for r in model_rules(model_arch(self.model)).values() if isinstance(r, Vocab)) + LLAMA_VOCAB


def holdings(model):
    """The holdings view of what a sliced source yields: itself when it is one, else Megatron's."""
    return model if hasattr(model, "pieces") and hasattr(model, "geometry") else MegatronHoldings(model)


def _world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _part(pieces: list, shape, t: Transfer) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the transfer's range, the local tensor it is cut from): a whole piece serves any range
    along any dim, a split one the ranges inside it along its dim."""
    for piece in pieces:
        if piece.dim is None or (piece.start == 0 and piece.stop == shape[piece.dim]):
            return piece.tensor.narrow(t.dim, t.start, t.stop - t.start), piece.tensor
        if piece.dim == t.dim and piece.start <= t.start and t.stop <= piece.stop:
            return piece.tensor.narrow(t.dim, t.start - piece.start, t.stop - t.start), piece.tensor
    raise PlanError(f"the plan sends {t.hf}[{t.start}:{t.stop}] from rank {t.src}, which does not hold it")


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class SlicedSync:
    def __init__(self, bucket_bytes: int, *, delta: bool = False):
        self.bucket_bytes = int(bucket_bytes)
        self.delta = delta
        self.plan: Optional[SyncPlan] = None
        self._key = None
        self.sent: Dict[Tuple[str, int, int], torch.Tensor] = {}  # delta: (hf, dst, start) -> last sent
        self.kept: Dict[str, torch.Tensor] = {}  # delta: hf -> this rank's slice as last received
        self.counts: Dict[str, float] = {}

    def reset(self) -> None:
        """Forget the delta copies (after a failed sync the sides may disagree): next sync dense."""
        self.sent.clear()
        self.kept.clear()

    # ------------------------------------------------------------------ the plan
    def prepare(self, model, keeps: Tuple[int, int], dtype: torch.dtype) -> SyncPlan:
        """The plan for this model and rollout layout (collective on the first call)."""
        key = (id(model), tuple(keeps), dtype)
        if self.plan is not None and key == self._key:
            return self.plan
        view = holdings(model)
        rank, world = _world()
        mine = dict(entries=view.entries(),
                    pieces=[(p.hf, p.dim, p.start, p.stop) for p in view.pieces()],
                    dp=view.dp_rank(), keeps=tuple(keeps))
        everyone: List[dict] = [None] * world  # type: ignore[list-item]
        if world > 1:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        order, shapes = [], {}
        for r in everyone:
            for hf, shape in r["entries"]:
                if hf not in shapes:
                    order.append(hf)
                    shapes[hf] = tuple(shape)
        held = [Holding(r, hf, dim, start, stop, everyone[r]["dp"])
                    for r in range(world) for hf, dim, start, stop in everyone[r]["pieces"]]
        head_dim, vocab_size = view.geometry()
        # the model's own vocabulary tensors (its accessors), where the view says (every view here does)
        vocab = view.vocab_names() if callable(getattr(view, "vocab_names", None)) else LLAMA_VOCAB
        needs = []
        for r in range(world):
            tp_rank, tp = everyone[r]["keeps"]
            slicer = RolloutSlicer(tp, head_dim=head_dim, vocab_size=vocab_size, vocab=vocab)
            for hf in order:
                dim, start, stop = slicer.need(hf, shapes[hf], tp_rank)
                needs.append(Need(r, hf, dim, start, stop, everyone[r]["dp"]))
        element_size = torch.empty((), dtype=dtype).element_size()
        self.plan = SyncPlan.build(rank, order, shapes, held, needs, element_size=element_size,
                                   bucket_bytes=self.bucket_bytes)
        self._key = key
        self.reset()
        log.info("sliced weight sync plan: %d tensors in %d buckets; this rank keeps %.1f M of the "
                 "model's %.1f M elements", len(order), len(self.plan.buckets),
                 self.plan.received_elements() / 1e6,
                 sum(torch.Size(s).numel() for s in shapes.values()) / 1e6)
        return self.plan

    # ------------------------------------------------------------------ one sync
    def stream(self, model, keeps: Tuple[int, int], dtype: torch.dtype) -> Iterator[Item]:
        plan = self.prepare(model, keeps, dtype)
        pieces: Dict[str, list] = {}
        for p in holdings(model).pieces():
            pieces.setdefault(p.hf, []).append(p)
        rank, world = _world()
        self.counts = dict(received=0, wire=0, dense=0, changed=0, elements=0, sent=0, peak_bucket=0,
                           largest=max((_numel(plan.shapes[hf]) for hf in plan.order), default=0)
                           * torch.empty((), dtype=dtype).element_size())

        def start(b: int):
            rows = plan.transfers[b]
            sends = [[t for t in rows if t.src == rank and t.dst == d] for d in range(world)]
            recvs = [[t for t in rows if t.dst == rank and t.src == s] for s in range(world)]
            return self._start(plan, pieces, sends, recvs, dtype)

        pending = start(0) if plan.buckets else None
        for b, members in enumerate(plan.buckets):
            current = pending
            # the next bucket's exchange runs (gloo's or NCCL's own threads/streams) while the
            # consumer loads this one
            pending = start(b + 1) if b + 1 < len(plan.buckets) else None
            got = self._finish(plan, current, dtype)
            current = None
            for i in members:
                hf = plan.order[i]
                part = got.pop(hf, None)
                if part is None:  # nothing to receive: an empty range (a rank of vocabulary padding)
                    part = self._slice_buffer(plan, hf, dtype, collective_device())
                yield hf, part, plan.needs[hf]
                part = None

    def _start(self, plan, pieces, sends, recvs, dtype):
        """Pack this rank's sends of one bucket, agree on the sizes, launch the exchange."""
        device = collective_device()
        element_size = torch.empty((), dtype=dtype).element_size()
        headers, slots, send_sizes, local = [], [], [], {}
        for d, rows in enumerate(sends):
            size = 0
            for t in rows:
                part, source = _part(pieces[t.hf], plan.shapes[t.hf], t)
                if not self.delta and d == plan.rank:  # to itself: no wire, no packing
                    local[(t.hf, t.start)] = part
                    continue
                if self.delta:
                    part = part.to(dtype).contiguous()
                    key = (t.hf, t.dst, t.start)
                    mode, count, payload = codec.encode(part, self.sent.get(key))
                    headers.append([mode, count, codec.checksum(part)])
                    # the copy kept must not be the live parameter the optimizer will move
                    self.sent[key] = part.clone() if _shares_storage(part, source) else part
                    slots.append(payload)
                    size += payload.numel()
                else:  # the view itself: cast and packed by the one copy into the send buffer
                    slots.append(part)
                    size += part.numel() * element_size
            send_sizes.append(size)
        flat = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
        offset = 0
        for x in slots:
            n = x.numel() if self.delta else x.numel() * element_size
            if self.delta:
                flat[offset:offset + n].copy_(x)
            else:  # dense payloads are whole elements: every offset is aligned for a typed view
                flat[offset:offset + n].view(dtype).view(x.shape).copy_(x)
            offset += n
        slots = None
        self.counts["sent"] += sum(send_sizes)
        if self.delta:  # (mode, count, checksum) per transfer: the receiver's sizes and its check
            head = _all_to_all(torch.tensor(headers, dtype=torch.int64, device=device).reshape(-1),
                               [3 * len(r) for r in sends], [3 * len(r) for r in recvs], device)
            head = head.reshape(-1, 3).tolist()
        else:
            head = [[codec.DENSE, 0, 0] for rows in recvs for _ in rows]
        recv_sizes, j = [], 0
        for s, rows in enumerate(recvs):
            size = 0
            for t in rows:
                if local and s == plan.rank:  # (dense: the part itself, not through the exchange)
                    j += 1
                    continue
                size += codec.payload_bytes(head[j][0], head[j][1], _numel(self._slice_shape(plan, t)),
                                            element_size)
                j += 1
            recv_sizes.append(size)
        # what this bucket holds here: its send buffer and its receive buffer
        self.counts["peak_bucket"] = max(self.counts["peak_bucket"], sum(send_sizes) + sum(recv_sizes))
        incoming, work = _all_to_all(flat, send_sizes, recv_sizes, device, wait=False)
        return recvs, head, incoming, work, flat, local

    def _finish(self, plan, started, dtype) -> Dict[str, torch.Tensor]:
        recvs, head, incoming, work, flat, local = started
        if work is not None:
            work.wait()
        flat = None  # noqa: F841 (the send buffer lives until the exchange is done)
        return self._unpack(plan, recvs, head, incoming, dtype, incoming.device, local)

    def _slice_buffer(self, plan: SyncPlan, hf: str, dtype, device) -> torch.Tensor:
        """Where this rank's slice of `hf` is assembled: a fresh tensor, or under delta the copy
        kept from the last sync (patched in place)."""
        kept = self.kept.get(hf) if self.delta else None
        if kept is None:
            kept = torch.empty(_need_shape(plan, hf), dtype=dtype, device=device)
            if self.delta:
                self.kept[hf] = kept
        return kept

    @staticmethod
    def _slice_shape(plan: SyncPlan, t: Transfer) -> Tuple[int, ...]:
        shape = list(plan.shapes[t.hf])
        shape[t.dim] = t.stop - t.start
        return tuple(shape)

    def _unpack(self, plan, recvs, head, incoming, dtype, device, local) -> Dict[str, torch.Tensor]:
        out: Dict[str, torch.Tensor] = {}
        element_size = torch.empty((), dtype=dtype).element_size()
        offset, j = 0, 0
        for rows in recvs:
            for t in rows:
                need = plan.needs[t.hf]
                n = _numel(self._slice_shape(plan, t))
                part = local.get((t.hf, t.start)) if t.src == plan.rank else None
                if part is not None:  # from this rank's own shard: its view, cast if need be
                    if t.hf not in out and n == _numel(_need_shape(plan, t.hf)):
                        out[t.hf] = part.to(dtype)  # a view of the parameter when nothing to cast
                    else:
                        if t.hf not in out:
                            out[t.hf] = self._slice_buffer(plan, t.hf, dtype, device)
                        base = need.start if need.dim == t.dim else 0
                        out[t.hf].narrow(t.dim, t.start - base, t.stop - t.start).copy_(part)
                    self._count(t, plan, n * element_size, n, element_size, n)
                    j += 1
                    continue
                if not self.delta and t.hf not in out and n == _numel(_need_shape(plan, t.hf)):
                    # one transfer carries the whole slice: use it where it landed, no copy
                    size = n * element_size
                    out[t.hf] = incoming[offset:offset + size].view(dtype).view(_need_shape(plan, t.hf))
                    self._count(t, plan, size, n, element_size, n)
                    offset, j = offset + size, j + 1
                    continue
                if t.hf not in out:
                    out[t.hf] = self._slice_buffer(plan, t.hf, dtype, device)
                base = need.start if need.dim == t.dim else 0
                region = out[t.hf].narrow(t.dim, t.start - base, t.stop - t.start)
                mode, count, check = head[j]
                size = codec.payload_bytes(mode, count, n, element_size)
                payload = incoming[offset:offset + size]
                if region.is_contiguous():
                    codec.decode(mode, count, payload, region)
                else:  # a column range of a row-major slice
                    staged = region.contiguous()
                    codec.decode(mode, count, payload, staged)
                    region.copy_(staged)
                if self.delta and codec.checksum(region) != check:
                    raise RuntimeError(f"delta sync: {t.hf}[{t.start}:{t.stop}] (dim {t.dim}) from "
                                       f"rank {t.src} does not match the sender's checksum")
                self._count(t, plan, size, n, element_size, count if self.delta else n)
                offset += size
                j += 1
        return out

    def _count(self, t: Transfer, plan: SyncPlan, size: int, n: int, element_size: int, changed: int) -> None:
        self.counts["received"] += size
        self.counts["wire"] += size if t.src != plan.rank else 0
        self.counts["dense"] += n * element_size
        self.counts["changed"] += changed
        self.counts["elements"] += n


def _need_shape(plan: SyncPlan, hf: str) -> Tuple[int, ...]:
    need, shape = plan.needs[hf], list(plan.shapes[hf])
    shape[need.dim] = need.stop - need.start
    return tuple(shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _all_to_all(send: torch.Tensor, send_sizes: List[int], recv_sizes: List[int], device, *,
                wait: bool = True):
    """One all_to_all_single over the default group (a copy in one process). wait=False: (the
    output, the work to wait on)."""
    out = torch.empty(sum(recv_sizes), dtype=send.dtype, device=device)
    work = None
    if len(send_sizes) == 1:
        out.copy_(send)
    else:
        work = dist.all_to_all_single(out, send, output_split_sizes=recv_sizes,
                                      input_split_sizes=send_sizes, async_op=not wait)
    return out if wait else (out, work)


__all__ = ["SlicedSync", "PlanError"]
