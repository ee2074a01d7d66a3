"""The batch format every training engine takes, and the row/column arithmetic on it.

A batch is a dict of tensors about B sequences, each a prompt followed by its response:

    input_ids          [B, S] long   prompt tokens then response tokens, RIGHT-padded (any pad id)
    prompt_lengths     [B]    long   >= 1
    response_lengths   [B]    long   >= 1 (0 allowed for forward-only roles); prompt + response <= S
    response_mask      [B, T] optional; default `t < response_lengths`. May be a subset of that
                                     (tool output tokens masked out), never beyond it.
    <per-token>        [B, T] any tensor of exactly this shape is per-response-token, right-padded
                                     and aligned with response_mask: old_log_probs, advantages,
                                     ref_log_probs, values, returns, ...
    <per-sequence>     [B]    anything else with B rows (data_source ids, scores, ...)
    image_inputs       list of B  a vision-language model's per-row image tensors (the processor's
                                     pixel_values, image_grid_thw; None for a row without images)
    routed_experts     [B, S, L, k] routing replay: each token's top-k experts per MoE layer, aligned
                                     with input_ids (verl_hpc.models.moe_routes)

T is response_mask's width when given, else max(response_lengths). Outputs of an engine are
`[B, T]`, zero where the response mask is 0 (per-sequence outputs are `[B]`).

Why right padding: with a causal mask a valid token only attends to earlier tokens, which are all
valid, so no padding mask is needed at all, positions are plain 0..S-1 (the same as an unpadded
Hugging Face forward), and Megatron's attention runs with attention_mask=None, i.e. causal only:
the local spec's softmax (megatron-core 0.16.1 FusedScaleMaskSoftmax.forward_torch_softmax, layers
built with attn_mask_type=causal) then builds the upper-triangular mask itself, the engine's SDPA
core attention passes is_causal=True, and TE's attention is causal by its mask type. Outputs at
padding positions are garbage and are masked out.
Rollout engines produce left-padded prompts; `pack_sequences` builds this format from token lists.

Alignment: the log-prob of response token t (input_ids[b, p + t], p = prompt_lengths[b]) comes from
the logits at position p + t - 1; a value head's value for token t likewise from position p + t - 1
(the state before the action), and a reward model's score from the sequence's last token p + r - 1.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

import torch

from verl_hpc.models.moe_routes import fit_width

Batch = Dict[str, torch.Tensor]
SEQUENCE_KEYS = ("input_ids", "prompt_lengths", "response_lengths")
# per-row values that are lists, not tensors: a vision-language model's image tensors per row
# ({pixel_values, image_grid_thw} or None), of a different size in every row
ROW_LISTS = ("image_inputs",)
# per row and sequence position (not per response token): cut like input_ids
SEQUENCE_WIDE = "routed_experts"


def as_engine_batch(batch) -> Mapping[str, torch.Tensor]:
    """This format of `batch`: a mapping as it is, or the trainer's typed batch (anything with
    `engine_batch()`, verl_hpc.trainer.stages.step_batch.StepBatch), which engines do not import."""
    return batch.engine_batch() if hasattr(batch, "engine_batch") else batch


def response_width(batch: Mapping[str, torch.Tensor]) -> int:
    if "response_mask" in batch:
        return int(batch["response_mask"].shape[1])
    return max(int(batch["response_lengths"].max()), 1) if batch["response_lengths"].numel() else 1


def check_batch(batch: Mapping[str, torch.Tensor], *, need_response: bool = True) -> None:
    """Raise a ValueError naming the key and rows at fault."""
    for key in SEQUENCE_KEYS:
        if key not in batch:
            raise ValueError(f"batch: missing {key!r}; a batch needs {', '.join(SEQUENCE_KEYS)} "
                             f"(see verl_hpc/engines/batch.py)")
    ids, plen, rlen = batch["input_ids"], batch["prompt_lengths"], batch["response_lengths"]
    if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"batch['input_ids']: expected an integer [B, S] tensor; got "
                         f"{tuple(ids.shape)} {ids.dtype}")
    b, s = ids.shape
    for key, t in (("prompt_lengths", plen), ("response_lengths", rlen)):
        if tuple(t.shape) != (b,):
            raise ValueError(f"batch[{key!r}]: expected shape ({b},) like input_ids' rows; got "
                             f"{tuple(t.shape)}")
    bad = ((plen < 1) | (plen + rlen > s) | (rlen < (1 if need_response else 0))).nonzero().flatten()
    if bad.numel():
        rows = bad[:10].tolist()
        raise ValueError(f"batch: rows {rows} need prompt_lengths >= 1, response_lengths >= "
                         f"{1 if need_response else 0} and prompt + response <= S={s}")
    t_width = response_width(batch)
    if int(rlen.max()) > t_width:
        raise ValueError(f"batch['response_mask'] has width {t_width} but the longest response "
                         f"has {int(rlen.max())} tokens")
    if "response_mask" in batch:
        mask = batch["response_mask"]
        beyond = mask.bool() & ~length_mask(rlen, t_width).to(mask.device)
        if tuple(mask.shape) != (b, t_width) or bool(beyond.any()):
            raise ValueError("batch['response_mask']: must be [B, T] and 0 beyond response_lengths")


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool, True for t < lengths[b]."""
    return torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def get_response_mask(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The response mask as float `[B, T]`."""
    if "response_mask" in batch:
        return batch["response_mask"].float()
    return length_mask(batch["response_lengths"], response_width(batch)).float()


def response_positions(prompt_lengths: torch.Tensor, width: int, seq_len: int) -> torch.Tensor:
    """[B, width] positions p + t - 1 whose outputs predict/score response token t (clamped into
    the sequence so padding columns index something valid; they are masked later)."""
    t = torch.arange(width, device=prompt_lengths.device).unsqueeze(0)
    return (prompt_lengths.unsqueeze(1) + t - 1).clamp(0, seq_len - 1)


def response_tokens(input_ids: torch.Tensor, prompt_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] the response tokens input_ids[b, p + t] (padding columns clamped)."""
    pos = (response_positions(prompt_lengths, width, input_ids.shape[1]) + 1).clamp(
        max=input_ids.shape[1] - 1)
    return input_ids.gather(1, pos)


def select_rows(batch: Mapping[str, torch.Tensor], rows: Sequence[int], *, pad_seq_to: int = 1) -> Batch:
    """The sub-batch of `rows`, cut to its own longest sequence (rounded up to `pad_seq_to`) and
    longest response, so a micro-batch of short sequences costs short-sequence compute. The
    rounding may go past the batch's own width (padded with zeros): FP8 GEMMs and sequence
    parallelism refuse any other length."""
    b, s = batch["input_ids"].shape
    t_full = response_width(batch)
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    plen, rlen = batch["prompt_lengths"][idx], batch["response_lengths"][idx]
    s_sub = max(int((plen + rlen).max()), 1) if len(idx) else 1
    s_sub = -(-s_sub // pad_seq_to) * pad_seq_to
    t_sub = max(int(rlen.max()), 1) if len(idx) else 1
    out: Batch = {}
    for key, value in batch.items():
        if key in ROW_LISTS and value is not None:
            out[key] = [value[i] for i in idx.tolist()]
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != b:
            continue  # not per-row: left out of micro-batches on purpose
        sub = value[idx.to(value.device)]
        if key == SEQUENCE_WIDE:  # per position like input_ids, MISSING where padded
            out[key] = fit_width(sub, s_sub)
            continue
        if key == "input_ids":
            if s_sub > s:
                sub = torch.nn.functional.pad(sub, (0, s_sub - s))
            sub = sub[:, :s_sub]
        elif value.dim() >= 2 and value.shape[1] == t_full:
            sub = sub[:, :t_sub]
        out[key] = sub
    if "response_mask" not in out:
        out["response_mask"] = length_mask(rlen, t_sub).float()
    return out


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   pad_id: int = 0, extra: Optional[Mapping[str, torch.Tensor]] = None) -> Batch:
    """Token lists -> the batch format (right-padded). `extra` tensors are added as they are."""
    if len(prompts) != len(responses):
        raise ValueError(f"pack_sequences: {len(prompts)} prompts but {len(responses)} responses")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    ids = torch.full((len(prompts), max(lengths, default=1)), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
    out: Batch = {"input_ids": ids,
                  "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long),
                  "response_lengths": torch.tensor([len(r) for r in responses], dtype=torch.long)}
    out.update(extra or {})
    return out


def split_rows(n: int, size: int) -> List[List[int]]:
    """[0..n) in consecutive chunks of `size` (the last may be shorter)."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
