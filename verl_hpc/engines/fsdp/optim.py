"""AdamW, the LR schedule and the guarded step of the FSDP engine, equal to the Megatron engine's.

- torch's fused AdamW over the sharded (DTensor) parameters; weight decay on matrices only, none on
  1-D parameters (norms, biases), as Megatron's optimizer groups them. The moments are DTensors
  sharded like their parameters.
- `LRSchedule`: linear warm-up from 0, then constant / linear / cosine decay to `min_lr`, counted
  in trainer steps (`verl_hpc.engines.megatron.optim.schedule_lr` is the same formula, checked
  against Megatron's OptimizerParamScheduler). Its state dict has the keys of Megatron's
  scheduler, so a checkpoint's schedule resumes in either engine.
- `guarded_step`: the gradient norm over every shard (the local shards' sums of squares in one
  foreach call, all-reduced over the mesh's shard dimension), read to the host together with the
  step's metric sums (one read before the optimizer's kernels), and when it or the loss is inf/nan
  nothing is applied; else clip (one foreach multiply) and step. Clipping scales by
  max_norm / (norm + 1e-6) when above max_norm, as Megatron's clip does.
- fp16 compute (`LossScaler`, when the compute dtype is float16): torch's ShardedGradScaler, which
  takes FSDP2's DTensor gradients (its unscale runs torch's fused check-and-unscale on them, then
  all-reduces the overflow flag over the world, so every shard agrees; plain torch.amp.GradScaler
  does not all-reduce it). The Megatron engine's rule (megatron/optim.py): an overflow skips the
  step (weights, Adam's moments and step count unchanged) and halves the scale;
  `optim.loss_scale_window` clean steps double it; torch's scaler has no floor, so `update`
  clamps it at `optim.min_loss_scale` as Megatron's does. The master weights and their gradients
  stay fp32 (MixedPrecisionPolicy's reduce dtype): the scale protects the fp16 backward only.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.megatron.optim import check_optim, schedule_lr


def build_optimizer(model: torch.nn.Module, optim, fused: bool = True) -> torch.optim.AdamW:
    """fused=False: torch's default (foreach), for fp16 compute: torch 2.13's fused step takes the
    sharded grad scaler's [1]-shaped overflow flag against its []-shaped step counts and fails."""
    check_optim(optim)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() == 1 or name.endswith(".bias") else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": optim.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    # fused: one kernel per device and dtype over all parameters, on CPU and GPU (torch's default
    # is foreach, several passes over the states); what transformers' Trainer runs (adamw_torch_fused)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                             weight_decay=optim.weight_decay, fused=fused or None)


class LRSchedule:
    """The LR by trainer step (see the module docstring); sets the optimizer's groups' lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, optim, total_steps: int):
        check_optim(optim)
        if optim.lr_decay_style != "constant" and optim.warmup_steps >= total_steps:
            raise ConfigError(f"optim.warmup_steps={optim.warmup_steps} must be below trainer.total_steps="
                              f"{total_steps} for lr_decay_style={optim.lr_decay_style!r}")
        self.optimizer, self.optim, self.total_steps = optimizer, optim, int(total_steps)
        # the peak and floor the schedule runs between: the rollback guard scales them
        # (verl_hpc/trainer/hooks/rollback.py set_lr_factor), as it does Megatron's scheduler's
        self.max_lr, self.min_lr = optim.lr, optim.min_lr
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        shape = dataclasses.replace(self.optim, lr=self.max_lr, min_lr=self.min_lr)
        lr = schedule_lr(shape, self.total_steps, self.num_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def step(self, increment: int = 1) -> None:  # Megatron's scheduler's signature
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> Dict[str, object]:
        o = self.optim
        decay = max(self.total_steps, o.warmup_steps + 1, 1)
        return {"max_lr": self.max_lr, "lr_warmup_steps": o.warmup_steps, "num_steps": self.num_steps,
                "lr_decay_style": o.lr_decay_style, "lr_decay_steps": decay, "min_lr": self.min_lr,
                "start_wd": o.weight_decay, "end_wd": o.weight_decay, "wd_incr_style": "constant",
                "wd_incr_steps": decay}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """The step count from a checkpoint (either engine's); the shape of the schedule is this
        job's config, as Megatron's `use_checkpoint_opt_param_scheduler` keeps the checkpoint's
        values only where they agree (the trainer checks the config on resume)."""
        self.num_steps = int(state["num_steps"])
        self._apply()


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else 0.0


# The norm and the clip over the gradients' local shards in one foreach call each (a multi-tensor
# kernel on a GPU), not one DTensor op per parameter: each of those goes through DTensor's dispatch
# on the host (sharding propagation) and launches its own kernel. False: the per-parameter forms
# (torch's get_total_norm with foreach=False, one mul_ per gradient), kept for the benchmark's
# fsdp_loopclip column (benchmarks/gpu_step_sides.py), which times them against the foreach ones.
FOREACH = True


def _layout(grad):
    """(mesh, placements) of a DTensor gradient; (None, None) for a plain tensor."""
    return getattr(grad, "device_mesh", None), getattr(grad, "placements", None)


def per_parameter_reason(grads) -> Optional[str]:
    """Why `grads` take the per-parameter norm rather than the foreach one (None: they take the
    foreach one): FOREACH off, gradients of several layouts (a plain tensor beside DTensors, meshes
    or placements that differ), or a partial placement (a sum still owed)."""
    if not FOREACH:
        return "optim.FOREACH is off"
    mesh, placements = _layout(grads[0])
    for g in grads[1:]:
        # equal, not the same object: a mesh equal to the first has the same ranks and groups
        if _layout(g) != (mesh, placements):
            return f"gradients of two layouts: {_layout(g)} beside {(mesh, placements)}"
    if placements is not None and any(p.is_partial() for p in placements):
        return f"a partial placement {placements}"
    return None


def grad_sq_sum(grads) -> torch.Tensor:
    """The sum of squares of `grads` over every shard, as a 0-d fp32 tensor on the gradients' device
    (no host read): each rank's local shards' sum of squares, all-reduced over the mesh dimensions
    they are sharded on (not over the replicas of HSDP, which hold the same values). Gradients of
    other layouts (per_parameter_reason) go through torch's get_total_norm."""
    if per_parameter_reason(grads) is not None:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return norm.float() ** 2
    mesh, placements = _layout(grads[0])
    local = [g.to_local() if mesh is not None else g for g in grads]
    sq = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local)).float()) ** 2
    for dim, p in enumerate(placements or ()):
        if p.is_shard() and mesh.size(dim) > 1:
            dist.all_reduce(sq, group=mesh.get_group(dim))
    return sq


def grad_norm(model: torch.nn.Module) -> float:
    """The global L2 norm of the gradients over every shard (a collective over the mesh)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return math.sqrt(float(grad_sq_sum(grads))) if grads else 0.0


def clip_grads(model: torch.nn.Module, coeff: float) -> None:
    """Every gradient times `coeff`, in place: the local shards in one foreach call."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    with torch.no_grad():
        if FOREACH:
            torch._foreach_mul_([g.to_local() if hasattr(g, "to_local") else g for g in grads], coeff)
        else:
            for g in grads:
                g.mul_(coeff)


class LossScaler(ShardedGradScaler):
    """ShardedGradScaler (growth 2, backoff 0.5) with Megatron's floor on the scale."""

    def __init__(self, device: str, init_scale: float, growth_interval: int, min_scale: float):
        super().__init__(device=device, init_scale=init_scale, growth_interval=growth_interval)
        self.min_scale = min_scale

    def update(self, new_scale=None) -> None:
        super().update(new_scale)
        if self._scale is not None:
            self._scale.clamp_(min=self.min_scale)


def loss_scaler(optim, compute_dtype: torch.dtype, device: torch.device) -> Optional[LossScaler]:
    """The fp16 loss scaler (None for bf16 / fp32 compute)."""
    if compute_dtype != torch.float16:
        return None
    return LossScaler(device.type, optim.initial_loss_scale, optim.loss_scale_window, optim.min_loss_scale)


def scaler_state(scaler) -> Dict[str, object]:
    """The scaler's state under the Megatron engine's keys (the checkpoint meta's `grad_scaler`:
    either engine resumes the other's; hysteresis is 1 in both)."""
    sd = scaler.state_dict()
    return {"scale": float(sd["scale"]), "growth_tracker": int(sd["_growth_tracker"]), "hysteresis_tracker": 1}


def load_scaler_state(scaler, state: Dict[str, object]) -> None:
    sd = scaler.state_dict()  # growth / backoff factors and interval: this job's config
    sd.update(scale=float(state["scale"]), _growth_tracker=int(state["growth_tracker"]))
    scaler.load_state_dict(sd)


def guarded_step(model: torch.nn.Module, optimizer, clip: float, sums: torch.Tensor,
                 scaler=None) -> Tuple[bool, float, bool, List[float]]:
    """(applied, grad_norm, found_inf, sums read): found_inf is the fp16 scaler's overflow (False
    without a scaler). `sums`: the step's metric sums, summed over the ranks and still on the device
    (engines/outputs.py sum_over_ranks, the loss first): read to the host together with the gradient
    norm, the step's one host read before the optimizer's kernels (a read is a wait for the device's
    queue to drain, then the device idles while the host launches the next kernels). A non-finite
    loss or norm applies nothing. Collective (the scaler's flag, the norm) whatever the outcome."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # in place; inf/nan stay inf/nan, so the norm shows an overflow
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = grad_sq_sum(grads) if grads else torch.zeros((), device=sums.device)
    sq = sq.reshape(1).to(sums.device, torch.float64, non_blocking=True)
    vals = torch.cat([sums.reshape(-1).double(), sq]).tolist()
    sums_read, sq_read = vals[:-1], vals[-1]
    norm = math.sqrt(sq_read) if sq_read >= 0 else float("nan")  # inf and nan stay what they are
    found_inf = scaler is not None and not math.isfinite(norm)
    if not math.isfinite(sums_read[0]) or not math.isfinite(norm):
        if scaler is not None:
            scaler.update()  # backs off after an overflow (and ends this step's unscale state)
        return False, norm, found_inf, sums_read
    if clip > 0.0:
        coeff = clip / (norm + 1e-6)
        if coeff < 1.0:
            clip_grads(model, coeff)
    if scaler is not None:
        scaler.step(optimizer)  # its own overflow flag is clear (the norm is finite): it steps
        scaler.update()
    else:
        optimizer.step()
    return True, norm, False, sums_read
