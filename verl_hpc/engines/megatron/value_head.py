"""A value head for critics and reward models: GPTModel with its vocabulary projection replaced by
a hidden -> 1 projection.

The head is replicated on every tensor-parallel rank (hidden floats: sharding it would save
nothing). The decoder's output is replicated over TP (without sequence parallelism), so every TP
rank computes the same values and the same head gradient; no TP communication is needed. With
sequence parallelism the hidden states are split along the sequence: they are gathered first, with
a backward that keeps each rank's own slice (each rank already holds the full loss).

Checkpoints: the backbone is a causal LM's (`model.*` names), loaded with
verl_hpc.models.load_hf_weights. The head is HF's `score.weight` ([1, hidden], as in
`LlamaForSequenceClassification`/`Qwen2ForSequenceClassification`) when the folder has one,
otherwise it starts as N(0, 0.02) from a fixed seed (the same on every rank and layout). Export
yields the backbone's HF tensors (no lm_head) and `score.weight`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Tuple

import torch
import torch.distributed as dist

from verl_hpc.models import export_hf_weights
from verl_hpc.models.hf_checkpoint import HFCheckpointReader, WeightFileError

log = logging.getLogger(__name__)

SCORE_NAME = "score.weight"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: (hidden [s, b, h], weight=..., ...) -> ([s, b, 1], None)."""

    def __init__(self, hidden: int, dtype: torch.dtype, device, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel  # GPTModel reads this attribute

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight), None


class _NoOutputLayer(torch.nn.Module):
    """Placeholder while loading/exporting the backbone (the HF mapping must not see the head)."""

    sequence_parallel = False

    def forward(self, *args, **kwargs):
        raise RuntimeError("value model used while its head was detached")


def causal_lm_config(cfg: dict) -> dict:
    """A config.json of a *ForSequenceClassification reward model, read as its causal LM (same
    backbone); embeddings untied (the head replaces the vocabulary projection)."""
    cfg = dict(cfg)
    archs = cfg.get("architectures") or []
    if len(archs) == 1 and archs[0].endswith(CLASSIFIER_SUFFIX):
        cfg["architectures"] = [archs[0][: -len(CLASSIFIER_SUFFIX)] + "ForCausalLM"]
    return cfg


@contextlib.contextmanager
def head_detached(gpt):
    head = gpt.output_layer
    gpt.output_layer = _NoOutputLayer()
    try:
        yield head
    finally:
        gpt.output_layer = head


def attach_value_head(gpt, folder, *, sequence_parallel: bool, seed: int = 1234) -> ValueHead:
    """Replace `gpt.output_layer` (call before loading weights) and initialise the head."""
    old = gpt.output_layer
    device, dtype = old.weight.device, old.weight.dtype
    head = ValueHead(gpt.config.hidden_size, dtype, device, sequence_parallel)
    reader = HFCheckpointReader(folder)
    with torch.no_grad():
        if SCORE_NAME in reader:
            score = reader.read(SCORE_NAME)
            if tuple(score.shape) != (1, gpt.config.hidden_size):
                raise WeightFileError(f"{folder}: {SCORE_NAME} has shape {tuple(score.shape)}; a value "
                                      f"head needs (1, {gpt.config.hidden_size})")
            head.weight.copy_(score)
        else:
            gen = torch.Generator().manual_seed(seed)
            head.weight.copy_(0.02 * torch.randn(1, gpt.config.hidden_size, generator=gen))
            log.info("value head: %s has no %s; initialised N(0, 0.02)", folder, SCORE_NAME)
    gpt.output_layer = head
    return head


def export_value_model(gpt_chunks, heads) -> Iterator[Tuple[str, torch.Tensor]]:
    """Backbone HF tensors then `score.weight` (from the last stage, broadcast over the pipeline)."""
    from megatron.core import parallel_state as ps

    stack = contextlib.ExitStack()
    with stack:
        for gpt in gpt_chunks:
            if gpt.post_process:
                stack.enter_context(head_detached(gpt))
        yield from export_hf_weights(gpt_chunks)
    hidden = gpt_chunks[0].config.hidden_size
    mine = [h for h in heads if h is not None]
    score = (mine[0].weight.detach().clone() if mine
             else torch.empty(1, hidden, dtype=gpt_chunks[0].config.params_dtype,
                              device=next(gpt_chunks[0].parameters()).device))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(score, src=dist.get_global_rank(group, group.size() - 1), group=group)
    yield SCORE_NAME, score
