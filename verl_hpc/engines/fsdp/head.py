"""The FSDP engine's output layer in chunks: the causal LM's own `lm_head` gives each scored token's
log-prob, entropy and sum-pi-squared (verl_hpc/engines/logits.py) instead of its logits.

    head = chunked_head(model, options)          # None: the model keeps its logits path
    if head is not None and head.takes(targets.numel()):  # more scored tokens than one chunk
        with head.scoring(rows, positions, targets, want):
            out = model(input_ids=..., logits_to_keep=...)
        result = head.results(out, want)         # {name: [n, T]}

Why inside the model's call: under FSDP2 the root unit's weights (the lm_head's, tied or not) are
gathered for its forward, and its backward hooks hang on the forward's outputs; computing the
results in the lm_head's place keeps both true. While `scoring` is open the lm_head takes its
input `[b, S, h]`, picks the scored positions (`hidden[rows, positions]` -> `[n, T, h]`) and
returns the stacked results `[n, T, k]` as the model's "logits"; outside it the lm_head is the
plain linear layer (generation, exports, other callers).

Models that change the logits after the lm_head (soft-capping, a logit scale) keep the whole-logits
path: the chunks would score a different distribution.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, Optional, Sequence

import torch

from verl_hpc.config.sections.model import logits_chunk_size, scores_in_chunks
from verl_hpc.engines.logits import token_outputs

log = logging.getLogger(__name__)

# config.json fields of transformers models that transform the logits after the lm_head
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                    "output_multiplier_scale")


def logits_transform(hf_config) -> Optional[str]:
    """The field of `hf_config` (or its text config) that changes the logits after the lm_head, if any."""
    configs = [hf_config] + [c for c in (getattr(hf_config, "text_config", None),) if c is not None]
    for cfg in configs:
        for name in LOGIT_TRANSFORMS:
            value = getattr(cfg, name, None)
            if value is not None and value != 1 and value != 1.0:
                return name
    return None


class ChunkedHead:
    def __init__(self, linear: torch.nn.Linear, chunk: int, temperature: float, liger: bool = False):
        self.linear, self.chunk, self.temperature = linear, chunk, temperature
        self.liger = liger  # log-probs alone through Liger's fused linear cross-entropy (liger.py)
        self._request = None
        plain = linear.forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            req = self._request
            return plain(hidden) if req is None else self._outputs(hidden, *req)

        linear.forward = forward  # an instance attribute: nn.Module.__call__ runs it, hooks unchanged

    def takes(self, scored_tokens: int) -> bool:
        """A micro-batch that fits one chunk keeps the whole-logits path (scores_in_chunks)."""
        return scores_in_chunks(self.chunk, scored_tokens)

    @contextlib.contextmanager
    def scoring(self, rows: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, want: Sequence[str]):
        """rows `[n, 1]` or `[n, T]`, positions `[n, T]` (in the lm_head's input), targets `[n, T]`."""
        self._request = (rows, positions, targets, tuple(want))
        try:
            yield self
        finally:
            self._request = None

    def _outputs(self, hidden, rows, positions, targets, want) -> torch.Tensor:
        if self.liger and want == ("log_probs",):
            from verl_hpc.engines.fsdp.liger import liger_log_probs

            logp = liger_log_probs(hidden[rows, positions], self.linear.weight, targets, self.temperature)
            return logp.unsqueeze(-1)
        out = token_outputs(hidden[rows, positions], self.linear.weight, targets, want,
                            temperature=self.temperature, chunk=self.chunk)
        return torch.stack([out[k] for k in want], dim=-1)

    @staticmethod
    def results(model_out, want: Sequence[str]) -> Dict[str, torch.Tensor]:
        stacked = model_out.logits if hasattr(model_out, "logits") else model_out[0]
        return {k: stacked[..., i] for i, k in enumerate(want)}


def chunked_head(model, options, liger: bool = False) -> Optional[ChunkedHead]:
    """The model's lm_head wrapped for chunked scoring, or None where the logits path stays:
    model.logits_chunk_tokens = 0, a value head, an lm_head with a bias or none, logits transformed
    after it. Said once in the log either way."""
    if options.head != "lm":
        return None
    linear = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    why_not = ("model.logits_chunk_tokens = 0" if options.logits_chunk_tokens == 0
               else "the model has no linear output layer" if not isinstance(linear, torch.nn.Linear)
               else "its output layer has a bias" if linear.bias is not None
               else "")
    transform = logits_transform(model.config)
    if transform and not why_not:
        why_not = f"config.json's {transform} changes the logits after the output layer"
    if why_not:
        _say("output layer: the whole logits per micro-batch (%s)", why_not)
        return None
    chunk = logits_chunk_size(options.logits_chunk_tokens, linear.out_features)
    _say("output layer: log-probs and entropy in chunks of %d tokens for micro-batches that score more "
         "(model.logits_chunk_tokens = %s)", chunk, "auto" if options.logits_chunk_tokens is None else options.logits_chunk_tokens)
    return ChunkedHead(linear, chunk, options.temperature, liger)


def _say(msg: str, *args) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(msg, *args)
