"""Which rows of a mini-batch each data-parallel rank takes, and how it cuts them into micro-batches.

Every rank receives the whole mini-batch and computes the whole plan itself (it is a pure function
of the sequence lengths), so ranks agree without talking.

- Fixed micro-batching (`micro_batch_size`): rank r takes a contiguous slice of the rows (sizes
  differ by at most one) and cuts it into chunks of `micro_batch_size`.
- Dynamic batching (`max_tokens_per_microbatch`): rows are spread over the data-parallel ranks by
  longest-processing-time greedy on their token counts (sort by length, give each to the least
  loaded rank that still has room for its share of rows), then each rank packs its rows, longest
  first, into micro-batches whose *padded* size (rows x longest row) stays within the budget. A
  row longer than the budget gets a micro-batch of its own. With prompt groups (the engine packs
  responses to one prompt, prefix.py), whole groups are spread instead of rows, and each rank
  packs a group's rows one after another.

Then every rank's micro-batch count is raised to the largest count of any rank: by halving its
micro-batch with the most rows, or, when no micro-batch has two rows, by adding empty micro-batches
(`[]`, which the engine runs as a dummy that contributes exactly zero loss and gradient). Megatron's
pipeline schedule needs the same count on all stages of a pipeline (same data-parallel rank, so
this holds anyway); equal counts across data-parallel ranks keep any per-micro-batch collective
(Transformer Engine's FP8 amax reduction) matched, and a rank with no rows at all still joins the
collectives. The loss does not depend on any of this: see engines/megatron/schedule.py.
"""
from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence

Plan = List[List[List[int]]]  # [dp_rank][micro_batch] -> row indices into the mini-batch


def contiguous_split(n: int, parts: int) -> List[List[int]]:
    """[0..n) in `parts` consecutive slices whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def balanced_split(lengths: Sequence[int], parts: int) -> List[List[int]]:
    """Rows spread over `parts` bins with near-equal token sums and row counts differing by at
    most one (longest-processing-time greedy). Deterministic: ties break by row and bin index."""
    n = len(lengths)
    caps = [len(s) for s in contiguous_split(n, parts)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    heap = [(0, p) for p in range(parts)]  # (tokens, bin)
    bins: List[List[int]] = [[] for _ in range(parts)]
    for i in order:
        load, p = heapq.heappop(heap)
        while len(bins[p]) >= caps[p]:  # a full bin leaves the heap for good
            load, p = heapq.heappop(heap)
        bins[p].append(i)
        heapq.heappush(heap, (load + lengths[i], p))
    return [sorted(b) for b in bins]


def grouped_split(lengths: Sequence[int], groups: Sequence[Sequence[int]], parts: int) -> List[List[int]]:
    """Whole groups spread over `parts` bins with near-equal token sums (longest-processing-time
    greedy on the groups' sums; row counts may differ by more than one)."""
    order = sorted(range(len(groups)), key=lambda g: (-sum(lengths[i] for i in groups[g]), g))
    heap = [(0, p) for p in range(parts)]
    bins: List[List[int]] = [[] for _ in range(parts)]
    for g in order:
        load, p = heapq.heappop(heap)
        bins[p].extend(groups[g])
        heapq.heappush(heap, (load + sum(lengths[i] for i in groups[g]), p))
    return [sorted(b) for b in bins]


def token_budget_microbatches(rows: Sequence[int], lengths: Sequence[int], max_tokens: int,
                              group_of: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Rows, longest first, packed into micro-batches with rows x longest <= max_tokens. With
    `group_of` (row -> group id), a group's rows come one after another (groups ordered by their
    longest row), so that responses to one prompt tend to share a micro-batch."""
    if group_of is None:
        order = sorted(rows, key=lambda i: (-lengths[i], i))
    else:
        longest: Dict[int, int] = {}
        for i in rows:
            longest[group_of[i]] = max(longest.get(group_of[i], 0), lengths[i])
        order = sorted(rows, key=lambda i: (-longest[group_of[i]], group_of[i], -lengths[i], i))
    out: List[List[int]] = []
    widest = 0
    for i in order:
        if out and (len(out[-1]) + 1) * max(widest, lengths[i]) <= max_tokens:
            out[-1].append(i)
            widest = max(widest, lengths[i])
        else:
            out.append([i])
            widest = lengths[i]
    return out


def equalize(microbatches: List[List[int]], count: int, lengths: Sequence[int]) -> List[List[int]]:
    """Raise the number of micro-batches to `count`: halve the largest, else add empty ones."""
    mbs = [list(m) for m in microbatches]
    while len(mbs) < count:
        k = max(range(len(mbs)), key=lambda j: (len(mbs[j]), -j)) if mbs else None
        if k is None or len(mbs[k]) < 2:
            mbs.append([])
            continue
        half = len(mbs[k]) // 2
        mbs[k:k + 1] = [mbs[k][:half], mbs[k][half:]]
    return mbs


def plan_microbatches(lengths: Sequence[int], dp: int, *, micro_batch_size: int = 0,
                      max_tokens: int = 0, multiple_of: int = 1,
                      groups: Optional[Sequence[Sequence[int]]] = None) -> Plan:
    """The whole plan: for each data-parallel rank, its micro-batches (lists of row indices).
    `lengths` are the sequences' token counts (prompt + response). `multiple_of`: the count is
    rounded up to a multiple of it (Megatron's interleaved schedule needs a multiple of pp).
    `groups` (rows that share a prompt; dynamic batching only): a group stays on one rank and its
    rows stay together in the budget packing, so the engine can pack the prompt once (prefix.py).
    Fixed micro-batches are contiguous slices already."""
    if max_tokens > 0:
        if groups:
            group_of = [0] * len(lengths)
            for g, rows in enumerate(groups):
                for i in rows:
                    group_of[i] = g
            shards = grouped_split(lengths, groups, dp)
        else:
            group_of, shards = None, balanced_split(lengths, dp)
        per_rank = [token_budget_microbatches(s, lengths, max_tokens, group_of) for s in shards]
    elif micro_batch_size > 0:
        shards = contiguous_split(len(lengths), dp)
        per_rank = [[s[i:i + micro_batch_size] for i in range(0, len(s), micro_batch_size)]
                    for s in shards]
    else:
        raise ValueError("micro_batch_size or max_tokens_per_microbatch must be positive; got "
                         f"{micro_batch_size} and {max_tokens}")
    count = max(1, max(len(m) for m in per_rank))
    count = -(-count // multiple_of) * multiple_of
    return [equalize(m, count, lengths) for m in per_rank]
