"""Per-micro-batch outputs from the last pipeline stage's model output, aligned to responses.

Language-model head: logits are vocab-parallel `[b, s, V/tp]` (this rank's slice of the padded
vocabulary; the padded columns are -inf, set by verl_hpc.models.gpt). Only the rows at response
positions are taken (`[b, T, V/tp]`), then
- log_probs: -`tensor_parallel.vocab_parallel_cross_entropy` (max and sum-exp all-reduced over the
  TP group, the target's logit from the rank that holds it); exp(-inf) = 0 keeps padded entries out;
- entropy: `verl_hpc.algorithms.entropy_from_logits` with a TP all-reduce, exact and with a
  communication-free backward;
- sum_pi_squared (forward only, the optimal token baseline's): `sum_pi_squared_from_logits` with
  the same all-reduce (the max, then one stacked sum).
Neither gathers the vocabulary. Megatron's cross-entropy works in place on float32 input (it turns
its argument into the softmax), so when entropy is also wanted it gets its own copy.

Log-probs only (no entropy, temperature 1): the model is called with `labels=` (the next token
at every position), so Megatron runs the same vocab-parallel cross-entropy on its `[s, b, V/tp]`
output-layer result directly, without materialising the transposed `[b, s, V/tp]` logits or the
response rows; the per-position losses `[b, s]` are then indexed at the response positions.

When the engine selects the output layer's positions (verl_hpc.models.gpt.select_output_positions:
an lm head without sequence parallelism or FP8), the model's output is already at the response
positions: logits `[b, T, V/tp]`, or with labels = the response tokens, losses `[b, T]`.

Chunked (model.logits_chunk_tokens != 0, the default, in a pass whose micro-batches score more
tokens than a chunk: `chunks_pass`; `ChunkedOutputLayer`): in the engine's own forwards
(`scoring()`) the output layer returns its input, the final hidden states (at the response
positions when selected), prepared for
tensor parallelism as its own forward prepares them (all-gathered from sequence-parallel slices;
under plain TP its backward all-reduces the hidden states' gradient, which is each rank's partial
sum over its vocabulary slice). `lm_outputs_chunked` then computes log-probs, entropy and
sum-pi-squared from them and the layer's weight (the embedding's when tied) in chunks of tokens
(verl_hpc/engines/logits.py): max and sums all-reduced over TP, the vocabulary's padded rows sliced
off (the -inf columns the whole-logits path masks add exactly nothing), no `[b, T, V/tp]` logits.
Not under context parallelism (context_parallel.py gathers the whole logits' per-token results).
On a GPU with model.logits_chunk_tokens auto (`LogitsChunk.auto`), every pass returns hidden
states and each micro-batch's scoring decides from the memory free at the output layer (the least
over the TP group: one path for all of it), by planning/output_layer.py's rule: the whole logits
where they fit (the output layer's matmul on the hidden states, the padded columns -inf as the
model's own mask makes them, then `lm_outputs`: kept by autograd, nothing recomputed), else the
fewest chunks that fit.

Value head: `[b, s, 1]` -> values `[b, T]` from positions p + t - 1, and the reward model's
sequence score from the last token p + r - 1.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, Optional, Sequence

import torch

from verl_hpc.algorithms import entropy_from_logits, process_group_all_reduce, sum_pi_squared_from_logits
from verl_hpc.engines.outputs import VALUE_OUTPUTS, value_outputs  # noqa: F401 (the engine picks it here)

LM_OUTPUTS = ("log_probs", "entropy", "sum_pi_squared")
log = logging.getLogger(__name__)


def _rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x[b, positions[b, t]] -> [b, T, ...]."""
    b = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    return x[b, positions]


def lm_outputs(logits: torch.Tensor, mb: Dict[str, torch.Tensor], want: Sequence[str],
               temperature: float = 1.0, selected: bool = False, fused_ce: bool = False) -> Dict[str, torch.Tensor]:
    """fused_ce (model.cross_entropy_loss_fusion, resolved): the log-probs of bf16 logits through
    Megatron's native fused cross-entropy (the same arithmetic, its steps compiled by jit_fuser; its
    backward returns a bf16 gradient, so other dtypes keep the unfused one)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    unknown = set(want) - set(LM_OUTPUTS)
    if unknown:
        raise ValueError(f"a language-model engine gives {LM_OUTPUTS}; asked for {sorted(unknown)}")
    resp = logits if selected else _rows(logits, mb["_positions"])
    if temperature != 1.0:  # rollout sampled from logits / temperature: score the same distribution
        resp = resp / temperature
    out: Dict[str, torch.Tensor] = {}
    tp_reduce = None
    if ps.get_tensor_model_parallel_world_size() > 1:
        tp_reduce = process_group_all_reduce(ps.get_tensor_model_parallel_group())
    if "entropy" in want:
        out["entropy"] = entropy_from_logits(resp, all_reduce=tp_reduce).float()
    if "sum_pi_squared" in want:
        out["sum_pi_squared"] = sum_pi_squared_from_logits(resp, all_reduce=tp_reduce).float()
    if "log_probs" in want:
        if fused_ce and resp.dtype == torch.bfloat16:  # upcasts to a copy first: entropy's input is untouched
            from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

            out["log_probs"] = -fused_vocab_parallel_cross_entropy(resp, mb["_targets"],
                                                                   ps.get_tensor_model_parallel_group())
            return out
        ce_input = resp.clone() if ("entropy" in want and resp.dtype == torch.float32) else resp
        out["log_probs"] = -vocab_parallel_cross_entropy(ce_input, mb["_targets"])
    return out


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """labels[b, i] = input_ids[b, i + 1] (the last position gets a dummy 0, never read)."""
    return torch.nn.functional.pad(input_ids[:, 1:], (0, 1))


def lm_outputs_from_token_losses(token_nll: torch.Tensor, mb: Dict[str, torch.Tensor],
                                 want: Sequence[str], selected: bool = False) -> Dict[str, torch.Tensor]:
    """Megatron's per-position loss `[b, s]` (labels = next tokens) -> log_probs `[b, T]`; with
    `selected` the loss is already `[b, T]` (labels = the response tokens)."""
    if tuple(want) != ("log_probs",):
        raise ValueError(f"the labels path gives log_probs only; asked for {tuple(want)}")
    return {"log_probs": -(token_nll if selected else token_nll.gather(1, mb["_positions"]))}


class ChunkedOutputLayer:
    """This rank's output layer (the last pipeline stage's) turned into a hidden-state pass-through
    (module docstring), and what the chunked scoring needs of it."""

    def __init__(self, layer, chunk: int, temperature: float):
        from megatron.core import parallel_state as ps

        self.layer, self.chunk, self.temperature = layer, chunk, temperature
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        width = layer.output_size_per_partition
        self.vocab_start = ps.get_tensor_model_parallel_rank() * width
        # the padded vocabulary's rows on this rank are cut off (verl_hpc.models.gpt records the real ones)
        self.real_columns = getattr(layer, "real_columns", width)
        self.weight = None  # the weight the model handed its output layer, taken at each forward
        self.last = None  # how the last micro-batch was scored ("whole" or its chunk size: reports)
        self.pending = lambda: 0  # Adam's state not yet created (wiring.pending_state_bytes; the engine sets it)
        self.free_read = None  # (free bytes agreed, pending bytes) at the last device-ruled decision (reports)
        self.fused_ce = bool(getattr(getattr(layer, "config", None), "cross_entropy_loss_fusion", False))
        layer.returns_hidden = False  # True while scoring; the padded-vocabulary mask hook then steps aside
        self._plain = layer.forward
        layer.forward = self._forward  # an instance attribute: the pre-hooks (position selection) still run

    @contextlib.contextmanager
    def scoring(self):
        """The engine's own forwards: hidden states out. Outside it the layer gives logits
        (exports, tests and tools that call the model)."""
        self.layer.returns_hidden = True
        try:
            yield
        finally:
            self.layer.returns_hidden = False

    def _forward(self, input_, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   gather_from_sequence_parallel_region)

        layer = self.layer
        if not layer.returns_hidden:
            return self._plain(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        self.weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                          group=self.group)
        elif self.tp > 1:
            hidden = copy_to_tensor_model_parallel_region(input_, group=self.group)
        else:
            return input_, None
        return _ContiguousGrad.apply(hidden), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. GPTModel transposes the output
    layer's result ([s, b] -> [b, s]), so the hidden states' gradient arrives as a transposed view,
    and Megatron's TP mappings all-reduce `grad.contiguous()`, a copy, returning the view
    unreduced (megatron-core 0.16.1 mappings._reduce): the ranks' partial sums would be lost."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class LogitsChunk(int):
    """Tokens per chunk (logits_chunk's answer), and whether model.logits_chunk_tokens was auto:
    then on a GPU the memory free at the output layer decides per micro-batch (module docstring)."""

    auto: bool = False

    @classmethod
    def of(cls, tokens: int, auto: bool) -> "LogitsChunk":
        c = cls(tokens)
        c.auto = auto and tokens > 0
        return c


def _device_ruled(chunk: int, device: torch.device) -> bool:
    from verl_hpc.engines.logits import device_free_bytes

    return bool(getattr(chunk, "auto", False)) and device_free_bytes(device) is not None


def logits_chunk(o, cp: int, vocab_columns: int) -> int:
    """Tokens per output-layer chunk on every rank (the same everywhere: the engine decides per pass
    whether its micro-batches go through the chunks, `scores_in_chunks`); 0: never chunked (a value
    head, context parallelism, whose outputs gather the whole logits' results, or
    model.logits_chunk_tokens = 0). vocab_columns: the padded vocabulary over tp."""
    from verl_hpc.config.sections.model import logits_chunk_size

    if o.head != "lm" or cp != 1 or o.logits_chunk_tokens == 0:
        return LogitsChunk.of(0, False)
    return LogitsChunk.of(logits_chunk_size(o.logits_chunk_tokens, vocab_columns), o.logits_chunk_tokens is None)


def chunked_output_layer(o, gpt_chunks, chunk: int) -> Optional[ChunkedOutputLayer]:
    """The chunked output layer on this rank's last stage, or None: chunk = 0 (logits_chunk), or no
    output layer on this rank."""
    from megatron.core import parallel_state as ps

    if chunk == 0:
        return None
    layer = next((g.output_layer for g in gpt_chunks if g.post_process), None)
    if layer is None:  # not the last pipeline stage
        return None
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        log.info("output layer: log-probs and entropy in chunks of %d tokens for micro-batches that score "
                 "more (model.logits_chunk_tokens = %s)",
                 chunk, "auto" if o.logits_chunk_tokens is None else o.logits_chunk_tokens)
    return ChunkedOutputLayer(layer, chunk, o.temperature)  # chunk keeps .auto: the device rule


def chunks_pass(chunk: int, mbs) -> bool:
    """Whether a pass over these micro-batches scores in chunks: one of them scores more tokens than a
    chunk (scores_in_chunks). Decided per pass, not per micro-batch, because the output layer's mode
    spans the pipeline schedule; every rank of a data-parallel group holds the same micro-batches,
    so the tensor- and pipeline-parallel ranks agree."""
    from verl_hpc.config.sections.model import scores_in_chunks

    mbs = list(mbs)
    if mbs and _device_ruled(chunk, mbs[0].data["_targets"].device):
        return True  # each micro-batch decides at the output layer (lm_outputs_chunked)
    return any(scores_in_chunks(chunk, mb.data["_targets"].numel()) for mb in mbs)


def lm_outputs_chunked(hidden: torch.Tensor, mb: Dict[str, torch.Tensor], want: Sequence[str],
                       head: ChunkedOutputLayer, selected: bool = False) -> Dict[str, torch.Tensor]:
    """Hidden states `[b, s, h]` (or `[b, T, h]` when selected) -> `{name: [b, T]}`."""
    from verl_hpc.engines.logits import agreed_free_bytes, token_outputs
    from verl_hpc.planning.output_layer import output_chunk

    resp = hidden if selected else _rows(hidden, mb["_positions"])
    chunk = int(head.chunk)
    if _device_ruled(head.chunk, resp.device):  # measured here, after every layer's activations
        pending = head.pending()
        free = agreed_free_bytes(resp.device, head.group, pending)
        head.free_read = (free + pending, pending)
        chunk = output_chunk(None, head.weight.shape[0], mb["_targets"].numel(), resp.element_size(), free,
                             want=want)
        head.last = chunk or "whole"
        if chunk == 0:
            return lm_outputs(whole_logits(resp, head), mb, want, head.temperature, selected=True,
                              fused_ce=getattr(head, "fused_ce", False))
    else:
        head.last = chunk
    return token_outputs(resp, head.weight[: head.real_columns], mb["_targets"], want,
                         temperature=head.temperature, chunk=chunk, group=head.group,
                         vocab_start=head.vocab_start)


def whole_logits(resp: torch.Tensor, head: ChunkedOutputLayer) -> torch.Tensor:
    """The output layer's logits `[b, T, V/tp]` from its input, as its own forward gives them: the
    matmul in the weights' dtype, this rank's padded vocabulary rows -inf (verl_hpc.models.gpt)."""
    logits = torch.nn.functional.linear(resp, head.weight)
    width = logits.shape[-1]
    if head.real_columns < width:
        pad = torch.arange(width, device=logits.device) >= head.real_columns
        logits = logits.masked_fill(pad, float("-inf"))
    return logits


def scoring(head: Optional[ChunkedOutputLayer]):
    """The engine's context for its schedules: hidden states out of the output layer where chunked."""
    return head.scoring() if head is not None else contextlib.nullcontext()
