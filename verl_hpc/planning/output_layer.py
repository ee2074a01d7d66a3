"""How the output layer scores a micro-batch: the whole logits, or chunks of how many tokens. One rule,
asked by both engines (engines/fsdp/head.py, engines/megatron/outputs.py) and by the memory plan
(planning/roles.py, planning/fsdp.py). Pure Python: the planner imports no torch.

    chunk = output_chunk(setting, vocab_columns, tokens, act_bytes, free_bytes)   # 0: the whole logits

- `setting` is model.logits_chunk_tokens: 0 = the whole logits always; n > 0 = chunks of n tokens
  for a micro-batch that scores more than n (a smaller one keeps the whole logits); None = auto.
- auto without a device figure (`free_bytes` None: a CPU, where memory is the host's and shared
  with everything else) keeps the fixed budget: one chunk's fp32 logits within 256 MiB
  (config/sections/model.py logits_chunk_size), the whole logits when the micro-batch fits one chunk.
  Pure Python still: the config layer imports no torch.
- auto on a device (`free_bytes`: what is free there when the output layer runs: in an engine, the
  device's free memory plus what torch's allocator holds unused, measured at the output layer; in
  the plan, the device's memory less every other component of that phase): DEVICE_SHARE of it is
  the output layer's. Where the whole logits' working set (bytes_per_logit: less where the update
  reads log-probs alone than with entropy) fits that, the whole logits (no chunks:
  their matmul and softmax run at full size and are not recomputed in the backward). Else the
  fewest chunks whose working set fits, all of one size (a multiple of CHUNK_ALIGN tokens).

Why the device rule: a fixed 256 MiB chunk is 2,096 tokens at V = 32,000 and 432 at V = 151,936,
so on a board with 80-141 GB every long micro-batch went through many small chunks (each a small
matmul and two passes over its logits), slower than the whole logits that would have fitted.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

DEVICE_SHARE = 0.5  # of the memory free at the output layer: the rest is the backward's and the allocator's slack
CHUNK_ALIGN = 256  # tokens: device chunks are multiples of this (full GEMM tiles), the last one included
MIN_CHUNK = 16
# Peak bytes per logit (token x vocabulary column) of the whole-logits path in an update, by what it
# reads. Measured on CPU as the peak of the live tensor storages over one forward + backward of
# engines/logits.py whole_outputs (n = 1,024, V = 50,000; fp32 and bf16 logits alike,
# tests/unit/engines/test_output_layer_rule.py measures it again): log-probs alone 12.0 (the logits,
# their fp32 copy, the log-softmax, its gradient); log-probs and entropy 29.0 (the entropy's softmax
# and its products, and their gradients, on top). One byte of slack each. 8 x 4,096 tokens at
# V = 151,936 with entropy are then 149 GB, which is why the whole logits ran out of a 141 GB board
# there; without entropy 65 GB.
WHOLE_BYTES_PER_LOGIT = 30  # log-probs and entropy (or sum-pi-squared): the planner's, where the loss is not known
LOG_PROBS_BYTES_PER_LOGIT = 13  # log-probs alone: an update whose loss has no entropy term
ENTROPY_LIKE = ("entropy", "sum_pi_squared")
CHUNK_TOKEN_BYTES = 32  # per scored token on the chunked path: 3 saved fp32 (max, log Z, entropy) + 3 outputs + slack


def chunk_working_bytes(chunk: int, vocab_columns: float, act_bytes: int) -> float:
    """One chunk's working logits: three fp32 [chunk, V/t] at once (forward: the shifted logits,
    their exp and its product with them; backward: log p, p and the gradient), plus the matmul's
    own result where it is below fp32 (its upcast is a copy)."""
    upcast = act_bytes if act_bytes < 4 else 0
    return float(chunk * vocab_columns * (12 + upcast))


def bytes_per_logit(want: Optional[Sequence[str]] = None) -> int:
    """The whole logits' peak bytes per logit for the outputs `want` (None: not known, the larger)."""
    if want is not None and not any(k in want for k in ENTROPY_LIKE):
        return LOG_PROBS_BYTES_PER_LOGIT
    return WHOLE_BYTES_PER_LOGIT


def whole_logits_bytes(tokens: int, vocab_columns: float, want: Optional[Sequence[str]] = None) -> float:
    """The whole logits' working set for `tokens` scored tokens giving `want` (bytes_per_logit)."""
    return float(tokens * vocab_columns * bytes_per_logit(want))


def cpu_chunk(vocab_columns: int) -> int:
    """Auto on a CPU: as many tokens as keep one chunk's fp32 logits within 256 MiB, a multiple of
    16, at least 16 (config/sections/model.py logits_chunk_size, the config check's rule too)."""
    from verl_hpc.config.sections.model import logits_chunk_size

    return logits_chunk_size(None, vocab_columns)


def device_chunk(tokens: int, vocab_columns: float, act_bytes: int, free_bytes: float,
                 want: Optional[Sequence[str]] = None) -> int:
    """Auto on a device: 0 (the whole logits) where they fit DEVICE_SHARE of `free_bytes`, else
    fitting_chunk."""
    budget = DEVICE_SHARE * max(float(free_bytes), 0.0)
    if whole_logits_bytes(tokens, vocab_columns, want) <= budget:
        return 0
    return fitting_chunk(tokens, vocab_columns, act_bytes, free_bytes)


def fitting_chunk(tokens: int, vocab_columns: float, act_bytes: int, free_bytes: float) -> int:
    """The size of the fewest equal chunks (multiples of CHUNK_ALIGN) whose working set fits
    DEVICE_SHARE of `free_bytes` (the smallest chunk where not even one aligned chunk does)."""
    budget = DEVICE_SHARE * max(float(free_bytes), 0.0)
    per_token = chunk_working_bytes(1, vocab_columns, act_bytes)
    room = budget - CHUNK_TOKEN_BYTES * tokens  # the per-token numbers are kept for every token
    largest = max(int(room // per_token) // CHUNK_ALIGN * CHUNK_ALIGN, 0)
    if largest < CHUNK_ALIGN:  # not even one aligned chunk fits: the smallest chunk (the plan says it is short)
        return max(MIN_CHUNK, min(int(room // per_token) // 16 * 16, CHUNK_ALIGN))
    pieces = math.ceil(tokens / largest)
    return min(largest, math.ceil(tokens / pieces / CHUNK_ALIGN) * CHUNK_ALIGN)


def output_chunk(setting: Optional[int], vocab_columns: int, tokens: int, act_bytes: int,
                 free_bytes: Optional[float] = None, want: Optional[Sequence[str]] = None) -> int:
    """Tokens per chunk for a micro-batch scoring `tokens` tokens over a vocabulary slice of
    `vocab_columns` (V / tp) for the outputs `want` (None: not known: as with entropy); 0 = the
    whole logits (module docstring)."""
    if setting is not None and setting < 0:
        raise ValueError(f"model.logits_chunk_tokens = {setting}; valid: null (auto), 0 (off) or a positive count")
    if setting == 0 or tokens <= 0:
        return 0
    if setting is None and free_bytes is not None:
        return device_chunk(tokens, vocab_columns, act_bytes, free_bytes, want)
    chunk = int(setting) if setting is not None else cpu_chunk(vocab_columns)
    return chunk if tokens > chunk else 0
