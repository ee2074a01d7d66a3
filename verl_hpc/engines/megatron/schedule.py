"""Micro-batches through Megatron's `get_forward_backward_func()` schedules, with exact loss scaling.

How the loss stays exactly the full-batch loss (megatron-core 0.16.1, checked in
pipeline_parallel/schedules.py `forward_step_calc_loss`, distributed/distributed_data_parallel.py
and distributed/finalize_model_grads.py):
- A loss callback returning a 2-tuple (loss, metrics) has its loss divided by the number of
  micro-batches (and multiplied by the CP size); DDP then scales gradients by 1/dp (or averages in
  the collective). Both assume equal micro-batches: with token-budget micro-batches of different
  sizes that weights a token by the size of the batch it landed in.
- We build the model with `calculate_per_token_loss=True` and return a 3-tuple (loss, num_tokens,
  metrics). Then the schedule does *not* divide, and DDP uses gradient_scaling_factor = 1.0, i.e. a
  plain SUM over data-parallel ranks (it also refuses average_in_collective). The only remaining
  scaling is in `finalize_model_grads(model, num_tokens)`, which divides every gradient by the
  summed num_tokens; we do not register it as `config.finalize_model_grads_func` and call it
  ourselves with num_tokens=None, so nothing is divided.
- Each micro-batch's loss is its contribution, aggregated with the counts of the whole batch
  (`GlobalCounts` -> `agg_loss(global_tokens=, global_seqs=, norm_len=)`). Sum over micro-batches
  (gradient accumulation) and DP ranks (DDP sum) = the full-batch loss: the gradient is that of the
  full batch whatever the split, with no multiply-then-divide round trip.
Empty micro-batches (see partition.py) run one 1-token dummy sequence whose loss is 0 * (finite
function of the output), so they add exactly zero.

Results of forward-only runs exist on the last pipeline stage (every TP rank has the same values).
TP rank 0 of the last stage writes its rows into zero `[K, B, T]` buffers, and one SUM all-reduce
over all ranks gives every rank the whole batch's outputs (rows are disjoint; x + 0 = x exactly).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from verl_hpc.engines.base import GlobalCounts
from verl_hpc.engines.batch import response_positions, response_tokens, select_rows
from verl_hpc.engines.megatron.context_parallel import split_for_rank
from verl_hpc.engines.megatron.outputs import next_token_labels
from verl_hpc.models.moe_routes import pack_routes

OutputFn = Callable[[torch.Tensor, Dict[str, torch.Tensor], Sequence[str]], Dict[str, torch.Tensor]]


class MicroBatch:
    """A micro-batch on the model's device: the rows' sub-batch (`data`, one row per sample, what
    the loss reads) plus the model's inputs and precomputed index tensors.

    The model's rows are the samples (right-padded, causal, positions 0..S-1), or, when
    `share_prompts` (prefix.PromptSharing) packs this micro-batch, one row per prompt with its
    responses after it: then `attention_mask` (a prefix.SegmentedAttention), `sample_rows`
    (sample -> model row) and per-row `position_ids` are set, and data["_positions"] index the
    packed rows.

    `shape=(rows, seq)` pads it to a fixed shape (Megatron's interleaved schedule exchanges
    activations of one fixed shape): extra rows are dummies cut off again before the loss.

    `cp_group` (context parallelism, never packed): the model gets this CP rank's tokens only
    (`model_input_ids`, `model_position_ids`, data["_cp_labels"]: context_parallel.py's split);
    `input_ids` and `shape` stay the whole sequence, which Megatron's schedules divide by cp.

    `vision` (a vision-language model's VisionArch): `position_ids` are M-RoPE's [3, rows, S] and
    `images` the model rows' pixel values and grids (vision.py), which the first stage embeds."""

    def __init__(self, batch: Mapping[str, torch.Tensor], rows: List[int], device, pad_seq_to: int,
                 shape: Optional[Tuple[int, int]] = None, share_prompts=None, cp_group=None, vision=None):
        self.rows = rows
        self.dummy = not rows
        if self.dummy:  # one sequence of one prompt token and no response token
            sub = {"input_ids": torch.zeros(1, pad_seq_to, dtype=torch.long),
                   "prompt_lengths": torch.ones(1, dtype=torch.long),
                   "response_lengths": torch.zeros(1, dtype=torch.long),
                   "response_mask": torch.zeros(1, 1)}
        else:
            sub = select_rows(batch, rows, pad_seq_to=pad_seq_to)
        if shape is not None:
            sub = _pad_to(sub, *shape)
        ids = sub["input_ids"]
        width = sub["response_mask"].shape[1]
        sub["_targets"] = response_tokens(ids, sub["prompt_lengths"], width)
        packed = share_prompts(sub, width, pad_seq_to) if share_prompts and not self.dummy else None
        row_images = sub.pop("image_inputs", None)  # a list per sample: not a tensor for the device
        self.packed = packed is not None
        self.attention_mask = self.sample_rows = None
        if packed is None:
            sub["_positions"] = response_positions(sub["prompt_lengths"], width, ids.shape[1])
            sub["_labels"] = next_token_labels(ids)
            self.input_ids = ids.to(device, non_blocking=True)
            self.position_ids = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(self.input_ids)
        else:
            sub["_positions"] = packed.positions
            self.input_ids = packed.input_ids.to(device, non_blocking=True)
            self.position_ids = packed.position_ids.to(device, non_blocking=True)
            self.attention_mask = packed.attention.to(device, non_blocking=True)  # sdpa.py reads it
            self.sample_rows = packed.sample_rows.to(device, non_blocking=True)
        self.images: Dict[str, torch.Tensor] = {}
        if vision is not None:
            from verl_hpc.engines.megatron.vision import model_inputs

            self.position_ids, self.images = model_inputs(vision, dict(sub, image_inputs=row_images), packed, device)
        self.cp = cp_group is not None and cp_group.size() > 1
        self.model_input_ids, self.model_position_ids = self.input_ids, self.position_ids
        if self.cp:
            if packed is not None:
                raise RuntimeError("context parallelism cannot take a packed micro-batch (prefix.py)")
            mine = split_for_rank({"input_ids": self.input_ids, "position_ids": self.position_ids,
                                   "labels": sub["_labels"]}, cp_group)
            self.model_input_ids, self.model_position_ids = mine["input_ids"], mine["position_ids"]
            sub["_cp_labels"] = mine["labels"]
        # routing replay: the routes in the model's own layout (packed rows when packed)
        self.model_routes = None
        if "routed_experts" in sub and not self.dummy:
            self.model_routes = sub["routed_experts"] if packed is None else pack_routes(
                sub["routed_experts"], sub["prompt_lengths"], sub["response_lengths"], packed.sample_rows,
                packed.positions, tuple(packed.input_ids.shape))
        self.data = {k: v.to(device, non_blocking=True) for k, v in sub.items()}
        # [rows, seq], True at padding (right padding, dummy rows): a router with a per-expert bias
        # (DeepSeek-V3) counts only real tokens towards its load (models/deepseek.py)
        self.padding_mask = None
        if packed is None and not self.cp and "response_lengths" in sub:
            real = sub["prompt_lengths"] + sub["response_lengths"]
            pad = torch.arange(ids.shape[1]).unsqueeze(0) >= (0 if self.dummy else real.unsqueeze(1))
            self.padding_mask = pad.to(device, non_blocking=True)
        self.tokens = 0.0 if self.dummy else float(sub["response_mask"].sum())
        self.real_rows = len(rows)

    def loss_view(self, output: torch.Tensor):
        """(output, data) without the padding rows."""
        n = self.real_rows
        if n == self.data["prompt_lengths"].shape[0]:
            return output, self.data
        return output[:n], {k: v[:n] for k, v in self.data.items()}

    @property
    def shape(self) -> Tuple[int, int]:
        """The model's input shape (rows, sequence)."""
        return tuple(self.input_ids.shape)


def _pad_to(sub: Dict[str, torch.Tensor], rows: int, seq: int) -> Dict[str, torch.Tensor]:
    """Pad a sub-batch with zero rows (prompt length 1, no response) and its sequences to `seq`."""
    b = sub["input_ids"].shape[0]
    out = {}
    for key, v in sub.items():
        if key == "input_ids":
            v = torch.nn.functional.pad(v, (0, seq - v.shape[1]))
        extra = rows - b
        if extra:
            fill = torch.ones if key == "prompt_lengths" else torch.zeros
            v = torch.cat([v, fill((extra,) + tuple(v.shape[1:]), dtype=v.dtype)])
        out[key] = v
    return out


def _dummy_loss(output: torch.Tensor) -> torch.Tensor:
    # -inf (padded vocabulary) must not meet the 0: 0 * -inf = nan.
    return torch.where(torch.isfinite(output), output, torch.zeros_like(output)).mean() * 0.0


def run_schedule(chunks, microbatches: List[MicroBatch], output_fn: OutputFn, want: Sequence[str],
                 *, loss_fn=None, counts: Optional[GlobalCounts] = None, forward_only: bool,
                 with_labels: bool = False, output_layers: Optional[Dict[int, Any]] = None,
                 rotary: Optional[Dict[int, Any]] = None, replay=None,
                 ) -> Tuple[List[Tuple[MicroBatch, Dict[str, torch.Tensor]]], List[dict]]:
    """Run all micro-batches. Forward-only: returns [(mb, detached outputs)] on the last stage.
    Training: returns per-micro-batch records {"loss", "tokens", metrics...} on the last stage.
    with_labels: call the model with next-token labels (its output is then the per-position
    cross-entropy, see outputs.py). output_layers: {id(chunk): its output layer} for chunks whose
    output layer runs on the response positions only (models.gpt.select_output_positions); their
    labels are then the response tokens. rotary: {id(chunk): its rotary embedding} for chunks that
    take per-row positions (models.gpt.per_row_positions), which packed micro-batches need.
    replay: a route_replay.RouteReplay whose routes (or recording) each forward uses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    collected: List[Tuple[MicroBatch, Dict[str, torch.Tensor]]] = []
    records: List[dict] = []
    # one iterator per virtual stage: each chunk walks the same micro-batches
    iters = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)

    def step(data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        layer = (output_layers or {}).get(id(model))
        rope = (rotary or {}).get(id(model))
        if mb.packed and rope is None and mb.position_ids.dim() == 2:  # M-RoPE's [3, b, s] are per row
            raise RuntimeError("a packed micro-batch needs per-row rotary positions on every chunk")
        # chunks without the output layer ignore labels; a packed micro-batch has no _labels
        per_position = layer is None and not mb.packed
        labels = (mb.data["_cp_labels"] if mb.cp else mb.data["_labels"] if per_position else mb.data["_targets"]
                  ) if with_labels else None
        if layer is not None:
            layer.selected_positions, layer.selected_rows = mb.data["_positions"], mb.sample_rows
        if rope is not None:
            rope.row_positions = mb.position_ids if mb.packed else None
        if replay is not None:
            replay.before(mb)
        try:
            extra = ({"padding_mask": mb.padding_mask} if mb.padding_mask is not None
                     and getattr(getattr(model, "config", None), "moe_router_enable_expert_bias", False) else {})
            output = model(mb.model_input_ids, mb.model_position_ids, mb.attention_mask, labels=labels, **extra,
                           **mb.images)
            if replay is not None:
                replay.after(mb)
        finally:
            if layer is not None:
                layer.selected_positions = layer.selected_rows = None
            if rope is not None:
                rope.row_positions = None

        def loss_callback(out):
            if forward_only:
                if not mb.dummy:
                    with torch.no_grad():
                        o, data = mb.loss_view(out)
                        collected.append((mb, {k: v.detach() for k, v in output_fn(o, data, want).items()}))
                return out.new_zeros(()), {}
            if mb.dummy:
                loss, metrics = _dummy_loss(out), {}
            else:
                o, data = mb.loss_view(out)
                loss, metrics = loss_fn(output_fn(o, data, want), data, counts)
                if o.shape[0] != out.shape[0]:  # padding rows join the graph with weight 0
                    loss = loss + _dummy_loss(out)
            records.append({"loss": loss.detach().float(), "tokens": mb.tokens,
                            **{k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}})
            # a fill on the device: torch.tensor(n, device=...) would copy a host number there,
            # blocking, between this micro-batch's forward and its backward
            num_tokens = torch.full((), int(mb.tokens), dtype=torch.int, device=loss.device)
            return loss, num_tokens, {}

        return output, loss_callback

    seq, mbs = max(mb.shape[1] for mb in microbatches), max(mb.shape[0] for mb in microbatches)
    try:
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iters, model=list(chunks),
            num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=mbs,
            forward_only=forward_only)
    finally:
        if replay is not None:
            replay.finish()
    return collected, records
