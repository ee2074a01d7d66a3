"""Shared prompt prefixes: one model row per prompt, its n responses side by side after it.

GRPO-style batches hold n responses to each prompt. Laid out one sequence per row (batch.py),
every row runs the same prompt through the model again: at 8 samples of a 17-token prompt and 24
response tokens, 41% of the tokens a training step computes are copies. Packed, a micro-batch row
is

    [prompt (p tokens) | response 1 (r1 - 1) | response 2 (r2 - 1) | ... | response k (rk - 1)]

with position ids 0..p-1 for the prompt and p..p+r_j-1 for every response (each response sees
the positions it had in its own sequence). A response token attends to the prompt and the earlier
tokens of its own response only: every response token then sees exactly the keys and values it had
in its own row, at the same rotary angles, so the log-probs are those of the unpacked layout up to
floating-point summation order, and the prompt's gradient is the sum of what its k copies
received. The log-prob of response token 0 comes from the prompt's last position, shared by all k.
A response's last token is left out: its output would score the token after the response, and no
scored position attends to it (in the plain layout it is computed and never read, like the padding).

Attention does not run over the packed row with a dense mask (S^2 pairs per row, most of them
masked, which a fused kernel still computes). `SegmentedAttention` says which packed positions each
response sees, and the core attention (sdpa.py) runs it as two SDPA calls: the prompts, causal, on
the first positions of every row; and every response's queries against the keys and values
gathered for it ([its prompt | its own tokens]), i.e. the attention of the plain layout minus the
prompt queries' copies. The outputs are scattered back into the packed row (padding gets zeros,
which nothing reads). `choose_layout` weighs the linear-layer work saved against the padding and
the attention pairs of both layouts with a cost model in units of one token's linear work
(`CostModel`), and keeps the plain layout where packing would not pay (single samples, a long
group beside short ones). Rotary angles per row come from `verl_hpc.models.gpt.per_row_positions`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from verl_hpc.engines.partition import plan_microbatches

# Packed rows longer than this stay unpacked whatever the cost model says (the gathered keys and
# values, and the index tensors, grow with the row).
MAX_PACKED_LEN = 4096


def prompt_groups(input_ids: torch.Tensor, prompt_lengths: torch.Tensor,
                  images: Optional[Sequence[Optional[Mapping[str, torch.Tensor]]]] = None) -> List[List[int]]:
    """Row indices grouped by identical prompt tokens, groups in order of first appearance, rows
    in their order within a group. `images` (a vision-language model's per-row image tensors): by
    tokens and images, since two pictures of one size under one question tokenize alike."""
    groups: Dict[tuple, List[int]] = {}
    lengths = prompt_lengths.tolist()
    seen: List[Mapping[str, torch.Tensor]] = []  # the distinct image sets so far
    for i, p in enumerate(lengths):
        key = tuple(input_ids[i, :p].tolist())
        if images is not None and images[i]:
            key += (_image_set(seen, images[i]),)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _image_set(seen: List[Mapping[str, torch.Tensor]], mine: Mapping[str, torch.Tensor]) -> int:
    """The index of `mine` among the distinct image sets `seen` (added when new); the same object is
    the same set, else equal tensors are."""
    for j, other in enumerate(seen):
        if other is mine or (other.keys() == mine.keys() and all(
                other[k].shape == mine[k].shape and torch.equal(other[k], mine[k]) for k in mine)):
            return j
    seen.append(mine)
    return len(seen) - 1


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Relative cost of a forward/backward: linear-layer work per token, attention work per
    (query, key) pair, both per layer. `pair_weight` is one pair's cost in tokens: 4h FLOPs (QK^T
    and PV) against the linear layers' 2 x (their parameters) FLOPs, times `mask_penalty` for
    the attention kernels' lower efficiency next to the GEMMs (5: set from a one-off profile on
    CPU at h=768 and ~200-token rows; a conservative weight keeps long rows unpacked)."""

    pair_weight: float

    @classmethod
    def for_config(cls, config, mask_penalty: float = 5.0) -> "CostModel":
        h = config.hidden_size
        kv = config.kv_channels * (config.num_query_groups or config.num_attention_heads)
        q = config.kv_channels * config.num_attention_heads
        ffn_mats = 3 if config.gated_linear_unit else 2
        linear = 2 * (h * (q + 2 * kv) + q * h + ffn_mats * h * config.ffn_hidden_size)
        return cls(pair_weight=mask_penalty * 4 * h / linear)

    def plain(self, lengths: Sequence[int]) -> float:
        """Rows padded to the longest; causal attention computes about half the pairs."""
        s = max(lengths)
        return len(lengths) * (s + self.pair_weight * s * s / 2)

    def packed(self, lengths: Sequence[int], prompt_lengths: Sequence[int],
               response_lengths: Sequence[int]) -> float:
        """Packed rows padded to the longest; attention as SegmentedAttention runs it: the prompts
        causal, padded to the longest prompt, and every response's queries (padded to the
        longest) against its gathered keys (padded to the longest prompt + response), masked."""
        s, p = max(lengths), max(prompt_lengths)
        q = max(max(r - 1, 0) for r in response_lengths)
        kv = max(a + max(r - 1, 0) for a, r in zip(prompt_lengths, response_lengths))
        pairs = len(lengths) * p * p / 2 + len(response_lengths) * q * kv
        return len(lengths) * s + self.pair_weight * pairs


def packed_lengths(groups: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                   response_lengths: Sequence[int]) -> List[int]:
    """Tokens of each packed row: the prompt, then every response but its last token."""
    return [prompt_lengths[g[0]] + sum(max(response_lengths[i] - 1, 0) for i in g) for g in groups]


def choose_layout(groups: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                  response_lengths: Sequence[int], cost: CostModel, force: bool = False) -> bool:
    """Pack this micro-batch? Only when some prompt has two or more responses in it, the rows
    stay within MAX_PACKED_LEN, the padded packed rows hold no more tokens than the padded plain
    ones (a token budget made for the plain layout holds: a large group beside a single response
    would pad that row to the group's length), and (unless `force`) the cost model predicts at
    least 10% less work than one sequence per row."""
    if max(len(g) for g in groups) < 2:
        return False
    packed = packed_lengths(groups, prompt_lengths, response_lengths)
    plain = [prompt_lengths[i] + response_lengths[i] for g in groups for i in g]
    if max(packed) > MAX_PACKED_LEN or len(packed) * max(packed) > len(plain) * max(plain):
        return False
    return force or cost.packed(packed, prompt_lengths, response_lengths) < 0.9 * cost.plain(plain)


@dataclasses.dataclass
class SegmentedAttention:
    """Who attends to what in packed rows, as index tensors for the core attention (sdpa.py).
    Positions are flat indices into the model's [S, g] layout (position * g + row).

    prompt_len: P, the longest prompt: the first P positions of every row run causal attention
      (a shorter prompt's row continues with its first response, whose causal view of the row's
      start is its own sequence: those outputs are not used).
    query_index [n, Q]: each response's token positions (padded with position 0 of its row);
    kv_index [n, L]: [its prompt | its own tokens] (padded likewise);
    allowed [n, 1, Q, L] bool: response token t sees the prompt and its tokens 0..t (a padded
      query sees the prompt, so no row is empty);
    source [S * g]: where each packed position's output comes from in
      cat([prompt outputs (P * g), response outputs (n * Q), one zero row])."""

    prompt_len: int
    query_index: torch.Tensor
    kv_index: torch.Tensor
    allowed: torch.Tensor
    source: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "SegmentedAttention":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return SegmentedAttention(self.prompt_len, move(self.query_index), move(self.kv_index),
                                  move(self.allowed), move(self.source))


@dataclasses.dataclass
class PackedRows:
    input_ids: torch.Tensor       # [g, S] long
    position_ids: torch.Tensor    # [g, S] long: each token's position in its own sequence
    segment: torch.Tensor         # [g, S] long: 0 prompt, j + 1 the row's response j, -1 padding
    attention: SegmentedAttention
    sample_rows: torch.Tensor     # [n] long: the packed row of each sample
    positions: torch.Tensor       # [n, T] long: the position whose logits score response token t

    def dense_mask(self) -> torch.Tensor:
        """[g, 1, S, S] bool, True = masked out (Megatron's convention): the same visibility as
        `attention` as one mask per row (the reference the segmented attention is tested against)."""
        s = self.segment.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        seg_q, seg_k = self.segment.unsqueeze(2), self.segment.unsqueeze(1)
        allowed = causal & ((seg_k == 0) | (seg_k == seg_q))  # padding sees earlier padding
        return (~allowed).unsqueeze(1)


def pack_rows(sub: Mapping[str, torch.Tensor], groups: Sequence[Sequence[int]], width: int,
              pad_to: int = 1) -> PackedRows:
    """Pack the samples of `sub` (batch format, rows = samples) by `groups` (indices into its
    rows, all rows covered once). Positions t >= a sample's response length point at its
    prompt's last token (never read)."""
    ids, plens, rlens = sub["input_ids"], sub["prompt_lengths"].tolist(), sub["response_lengths"].tolist()
    n = ids.shape[0]
    seq = max(packed_lengths(groups, plens, rlens))
    seq = -(-seq // pad_to) * pad_to
    g = len(groups)
    input_ids = torch.zeros(g, seq, dtype=ids.dtype)
    position_ids = torch.zeros(g, seq, dtype=torch.long)
    segment = torch.full((g, seq), -1, dtype=torch.long)
    sample_rows = torch.empty(n, dtype=torch.long)
    positions = torch.empty(n, width, dtype=torch.long)
    offsets, kept, own_prompt = [0] * n, [0] * n, [0] * n
    t = torch.arange(width)
    for row, members in enumerate(groups):
        p = plens[members[0]]
        input_ids[row, :p] = ids[members[0], :p]
        position_ids[row, :p] = torch.arange(p)
        segment[row, :p] = 0
        offset = p
        for j, i in enumerate(members):
            r = rlens[i]
            k = max(r - 1, 0)  # the last token is never an input that anything reads
            input_ids[row, offset:offset + k] = ids[i, p:p + k]
            position_ids[row, offset:offset + k] = torch.arange(p, p + k)
            segment[row, offset:offset + k] = j + 1
            sample_rows[i] = row
            # token 0 is scored at the prompt's last position, token t > 0 at its predecessor
            positions[i] = torch.where((t == 0) | (t >= r), p - 1, offset + t - 1)
            offsets[i], kept[i], own_prompt[i] = offset, k, p
            offset += k
    attention = _segmented_attention(sample_rows, torch.tensor(own_prompt), torch.tensor(offsets),
                                     torch.tensor(kept), segment)
    return PackedRows(input_ids, position_ids, segment, attention, sample_rows, positions)


def _segmented_attention(rows: torch.Tensor, prompt: torch.Tensor, offset: torch.Tensor,
                         kept: torch.Tensor, segment: torch.Tensor) -> SegmentedAttention:
    """SegmentedAttention from per-sample [n] tensors: packed row, prompt length, offset of the
    first response token in the row, response tokens in the row."""
    g, seq = segment.shape
    n = rows.shape[0]
    big_p = int(prompt.max())
    q_len = max(int(kept.max()), 1)
    kv_len = int((prompt + kept).max())
    t = torch.arange(q_len).unsqueeze(0)   # [1, Q]
    l = torch.arange(kv_len).unsqueeze(0)  # [1, L]
    p, off, k, row = (x.unsqueeze(1) for x in (prompt, offset, kept, rows))
    query_pos = torch.where(t < k, off + t, 0)
    in_prompt, in_response = l < p, (l >= p) & (l < p + k)
    kv_pos = torch.where(in_prompt, l, torch.where(in_response, off + l - p, 0))
    allowed = in_prompt.unsqueeze(1) | (in_response.unsqueeze(1) & ((l - p).unsqueeze(1) <= t.unsqueeze(2)))
    zero_row = big_p * g + n * q_len
    source = torch.full((seq, g), zero_row, dtype=torch.long)
    prompt_pos = torch.arange(big_p).unsqueeze(1) * g + torch.arange(g).unsqueeze(0)  # [P, g]
    source[:big_p] = torch.where(segment[:, :big_p].t() == 0, prompt_pos, zero_row)
    flat = source.view(-1)
    valid = (t < k).expand(n, q_len)
    flat[(query_pos * g + row)[valid]] = (big_p * g + torch.arange(n * q_len).view(n, q_len))[valid]
    return SegmentedAttention(big_p, query_pos * g + row, kv_pos * g + row, allowed.unsqueeze(1), flat)


class PromptSharing:
    """The engine's per-micro-batch decision: `sharing(sub, width, pad_to)` -> PackedRows when
    this micro-batch is packed, None when it keeps one sequence per row."""

    def __init__(self, cost: CostModel, force: bool = False):
        self.cost, self.force = cost, force

    def __call__(self, sub: Mapping[str, torch.Tensor], width: int, pad_to: int = 1):
        groups = prompt_groups(sub["input_ids"], sub["prompt_lengths"], sub.get("image_inputs"))
        if not choose_layout(groups, sub["prompt_lengths"].tolist(), sub["response_lengths"].tolist(),
                             self.cost, self.force):
            return None
        return pack_rows(sub, groups, width, pad_to)


def rank_microbatches(batch: Mapping[str, torch.Tensor], rows: Sequence[int], dp: int, dp_rank: int, *,
                      micro_batch_size: int, max_tokens: int, share_prompts: bool,
                      multiple_of: int = 1) -> List[List[int]]:
    """This data-parallel rank's micro-batches (batch rows) of `rows`, planned over those rows only
    (partition.plan_microbatches) as both engines plan them: under prompt sharing with a token
    budget a prompt's responses stay together. No rows still gives every rank a micro-batch (an
    empty one), so every rank enters the same collectives."""
    lengths = (batch["prompt_lengths"] + batch["response_lengths"])[list(rows)].tolist()
    groups = None
    if share_prompts and max_tokens > 0:
        images = batch.get("image_inputs")
        groups = prompt_groups(batch["input_ids"][list(rows)], batch["prompt_lengths"][list(rows)],
                               None if images is None else [images[i] for i in rows])
    plan = plan_microbatches(lengths, dp, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                             multiple_of=multiple_of, groups=groups)
    return [[rows[i] for i in mb] for mb in plan[dp_rank]]  # plan indices -> batch rows
