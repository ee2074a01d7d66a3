"""The `TrainingEngine` interface (docs/architecture.md) that the trainer's roles are written against.

Every method is a collective over all ranks of the engine (one SPMD program): every rank calls it
with the same whole batch (verl_hpc/engines/batch.py) and gets the same result back. How the
engine spreads the batch over its data, tensor and pipeline parallel ranks is its own business.

    out     = engine.forward(batch)                 # {"log_probs", "entropy"} | {"values"} | ...
    metrics = engine.train_step(batch, loss_fn)     # one optimizer step over the whole batch
    for hf_name, tensor in engine.export_hf_weights(): ...
    st      = engine.state(); engine.load_state(reader.load_into, st.meta)

Loss functions (`LossFn`) see one micro-batch at a time and must return its *contribution* to
the full-batch loss, i.e. aggregate with the global counts the engine passes (`GlobalCounts`,
verl_hpc.algorithms.agg_loss's contract): the engine sums contributions over micro-batches and
data-parallel ranks, so the loss and its gradient do not depend on the split.

State contract (`EngineState`), for the HDF5 checkpoint layer (verl_hpc.checkpoint):
- `tensors`: `ShardedTensor(name, local, global_shape, offsets)` slabs, layout independent: the
  names and global shapes are the same at every TP/PP/DP layout, so a checkpoint written at one
  layout loads at another. `local` tensors are views of live storage (copy before the next step).
    model/<param>              the parameters (global layer numbers; vocabulary rows without
                               Megatron's TP padding; fused gate/up weights as `.../gate`, `.../up`)
    optim/exp_avg/<param>      Adam moments (DistributedOptimizer: each rank's flat range of the
    optim/exp_avg_sq/<param>   parameter, cut into boxes; plain optimizers: the whole TP shard)
    optim/main/<param>         fp32 master weights, only when the model is not fp32
- `meta`: a JSON-able dict: format version, head, dtype, optimizer step count, LR scheduler state
  (Megatron's OptimizerParamScheduler.state_dict()), grad-scaler state (fp16 only).
- `load_state(load_into, meta)`: the engine builds the slabs it needs at its own layout (views
  into its parameters and optimizer states, creating empty optimizer states first) and calls
  `load_into(slabs)` once, which must fill each slab's `local` in place (exactly what
  `CheckpointReader.load_into` does); then it restores the rest from `meta`. When `load_into`
  also lists what the checkpoint holds (`stored()`: the checkpointer's RoleLoader), the engine
  first refuses a checkpoint of another model (engines/state_check.py), before changing anything.
  Either engine reads the other's state where both name it alike (docs/checkpoints.md, "Across
  engines").
"""
from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class GlobalCounts:
    """Totals over the whole batch handed to train_step (all data-parallel ranks together)."""

    tokens: float  # valid response tokens (response_mask sum)
    seqs: float  # sequences
    norm_len: float  # the constant of seq-mean-token-sum-norm (default: the batch's T)
    # valid tokens of the rows the engine runs: `tokens` less those of rows left out because the
    # loss says they add nothing (LossFn.rows_without_gradient); the engine's metric means are over
    # these. None: every row runs.
    run_tokens: Optional[float] = None

    def agg_kwargs(self) -> Dict[str, float]:
        """Keyword arguments for verl_hpc.algorithms losses / agg_loss."""
        return {"global_tokens": self.tokens, "global_seqs": self.seqs, "norm_len": self.norm_len}


class LossFn(Protocol):
    """(outputs of the micro-batch with grad, the micro-batch, global counts) -> (loss
    contribution, metrics). Metrics are 0-d tensors, means over the micro-batch's valid tokens;
    the engine reports their token-weighted mean over the batch.

    Optional: `rows_without_gradient(batch) -> [B] bool tensor or None`, the rows of the whole
    (mini-)batch (given with its response_mask) whose contribution to the loss and to its gradient
    is exactly 0. A training engine may leave them out of the forward and backward; the counts
    still include them, so the update is the same. Without the method, or when it returns None,
    every row runs."""

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Mapping[str, torch.Tensor],
                 counts: GlobalCounts) -> Tuple[torch.Tensor, Mapping[str, torch.Tensor]]: ...


@dataclasses.dataclass
class EngineState:
    tensors: List[Any]  # verl_hpc.checkpoint.ShardedTensor
    meta: Dict[str, Any]


class TrainingEngine(abc.ABC):
    """One model (actor, critic, reference or reward model) sharded over the job's ranks."""

    #: what `forward` returns by default, e.g. ("log_probs", "entropy") or ("values",)
    default_outputs: Tuple[str, ...] = ()

    @abc.abstractmethod
    def forward(self, batch: Mapping[str, torch.Tensor],
                outputs: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
        """No-grad outputs for the whole batch, `[B, T]` aligned with the response mask (zero on
        padding) or `[B]` per sequence; CPU tensors, identical on every rank."""

    @abc.abstractmethod
    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn,
                   outputs: Sequence[str] = ()) -> Dict[str, float]:
        """One optimizer step on the whole batch. Returns metrics (identical on every rank):
        loss, grad_norm, lr, the loss_fn's metrics, and `nonfinite` = 1.0 when the loss or the
        gradient was inf/nan, in which case the parameters and optimizer were left untouched.
        With fp16 loss scaling also `loss_scale` (the scale after this step) and `overflow` = 1.0
        when the step was skipped because the scaled gradients overflowed (skipped_for_overflow:
        then `nonfinite` is 0, the scale halved and nothing else changed)."""

    @abc.abstractmethod
    def export_hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(HF name, full tensor) on every rank, in the same order (a collective iterator)."""

    @abc.abstractmethod
    def state(self) -> EngineState: ...

    @abc.abstractmethod
    def load_state(self, load_into: Callable[[Sequence[Any]], None], meta: Mapping[str, Any]) -> None: ...

    def scheduler_step(self) -> float:
        """Advance the learning-rate schedule by one trainer step; returns the new LR. Only when
        an optimizer step was applied since the last call: an update whose steps were all skipped
        (fp16 overflow, non-finite loss) leaves the schedule where it was, as Megatron-LM's
        train_step advances its scheduler only after a successful update."""
        return 0.0


def skipped_for_overflow(applied: bool, found_inf: bool, loss: float, scale: Optional[float], optim) -> bool:
    """Whether a skipped step was the fp16 loss scaler's ordinary overflow (the scale was too high
    for this step's gradients; it has halved, the next step retries) rather than a non-finite
    loss or gradient: the loss was finite, the scaler found inf/nan in the gradients, and the
    scale was still above `optim.min_loss_scale`. At the floor an overflow is a real non-finite
    gradient, which the trainer's guard counts (`nonfinite`)."""
    return (not applied and found_inf and scale is not None and math.isfinite(loss)
            and scale > optim.min_loss_scale)


def scaler_metrics(overflow: bool, scale: Optional[float]) -> Dict[str, float]:
    """{"loss_scale", "overflow"} of a step with fp16 loss scaling; {} without a scaler."""
    return {} if scale is None else {"loss_scale": float(scale), "overflow": 1.0 if overflow else 0.0}
