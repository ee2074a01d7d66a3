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

How a micro-batch is scored is planning/output_layer.py's rule (`output_chunk`). On a CPU, and with
an explicit model.logits_chunk_tokens, `takes` decides before the model's call (a micro-batch within
one chunk keeps the engine's own whole-logits path). On a GPU with auto, the head always takes the
call and decides inside it, from the memory free there (the activations of every layer already
held): the whole logits where they fit (`whole_outputs`: computed once, kept by autograd), else
the fewest chunks that fit.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, Optional, Sequence

import torch

from verl_hpc.config.sections.model import logits_chunk_size, scores_in_chunks
from verl_hpc.engines.logits import device_free_bytes, token_outputs, whole_outputs
from verl_hpc.planning.output_layer import output_chunk

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
    def __init__(self, linear: torch.nn.Linear, chunk: int, temperature: float, liger: bool = False,
                 setting: Optional[int] = -1):
        self.linear, self.chunk, self.temperature = linear, chunk, temperature
        self.liger = liger  # log-probs alone through Liger's fused linear cross-entropy (liger.py)
        # model.logits_chunk_tokens (None = auto: on a device the free memory decides); -1: `chunk` as given
        self.setting = chunk if setting == -1 else setting
        self.last = None  # how the last micro-batch was scored: "liger", "whole" or its chunk size (reports)
        # bytes the device will hold at this point of later steps that it does not yet (Adam's
        # state before the first step: logits.pending_adam_bytes); the engine sets it
        self.pending = lambda: 0
        self.free_read = None  # (free bytes read, pending bytes) at the last device-ruled decision (reports)
        self._request = None
        plain = linear.forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            req = self._request
            return plain(hidden) if req is None else self._outputs(hidden, *req)

        linear.forward = forward  # an instance attribute: nn.Module.__call__ runs it, hooks unchanged

    def takes(self, scored_tokens: int) -> bool:
        """Whether the head scores this micro-batch. Auto on a device: always (it decides inside, at
        the output layer, module docstring); else a micro-batch that fits one chunk keeps the
        engine's whole-logits path (scores_in_chunks)."""
        if self.device_ruled():
            return True
        return scores_in_chunks(self.chunk, scored_tokens)

    def device_ruled(self) -> bool:
        """Auto on a device: the chunk size comes from the memory free at the output layer. The
        compute device: the weight's, or the current GPU where fsdp.cpu_offload keeps the shards on
        the host."""
        from verl_hpc.runtime.device import compute_device

        dev = self.linear.weight.device
        if dev.type == "cpu":
            dev = compute_device()
        return self.setting is None and device_free_bytes(dev) is not None

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

            self.last = "liger"
            logp = liger_log_probs(hidden[rows, positions], self.linear.weight, targets, self.temperature)
            return logp.unsqueeze(-1)
        sel = hidden[rows, positions]
        chunk = self.chunk
        if self.device_ruled():  # measured here: every layer's activations are already held
            free, pending = device_free_bytes(sel.device), self.pending()
            self.free_read = (free, pending)
            chunk = output_chunk(None, self.linear.out_features, targets.numel(), sel.element_size(),
                                 free - pending, want=want)
        if chunk == 0:
            self.last = "whole"
            out = whole_outputs(sel, self.linear.weight, targets, want, temperature=self.temperature)
        else:
            self.last = chunk
            out = token_outputs(sel, self.linear.weight, targets, want, temperature=self.temperature, chunk=chunk)
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
    head = ChunkedHead(linear, chunk, options.temperature, liger, setting=options.logits_chunk_tokens)
    if head.device_ruled():
        _say("output layer: the whole logits where they fit half the device memory free at the output layer, "
             "else the fewest chunks that do (model.logits_chunk_tokens = auto, planning/output_layer.py)")
    else:
        _say("output layer: log-probs and entropy in chunks of %d tokens for micro-batches that score more "
             "(model.logits_chunk_tokens = %s)", chunk,
             "auto" if options.logits_chunk_tokens is None else options.logits_chunk_tokens)
    return head


def _say(msg: str, *args) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(msg, *args)
