"""AdamW, the LR schedule and the guarded step of the FSDP engine, equal to the Megatron engine's.

- torch's AdamW over the sharded (DTensor) parameters; weight decay on matrices only, none on
  1-D parameters (norms, biases), as Megatron's optimizer groups them. The moments are DTensors
  sharded like their parameters.
- `LRSchedule`: linear warm-up from 0, then constant / linear / cosine decay to `min_lr`, counted
  in trainer steps (`verl_hpc.engines.megatron.optim.schedule_lr` is the same formula, checked
  against Megatron's OptimizerParamScheduler). Its state dict has the keys of Megatron's
  scheduler, so a checkpoint's schedule resumes in either engine.
- `guarded_step`: the gradient norm over every shard (torch's clip_grad_norm_ on DTensors reduces
  over the mesh), and when it or the loss is inf/nan nothing is applied; else clip and step.
  Clipping scales by max_norm / (norm + 1e-6) when above max_norm, as Megatron's clip does.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.megatron.optim import check_optim, schedule_lr


def build_optimizer(model: torch.nn.Module, optim) -> torch.optim.AdamW:
    check_optim(optim)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() == 1 or name.endswith(".bias") else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": optim.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                             weight_decay=optim.weight_decay)


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


def grad_norm(model: torch.nn.Module) -> float:
    """The global L2 norm of the gradients over every shard (a collective over the mesh)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def guarded_step(model: torch.nn.Module, optimizer, clip: float, loss_is_finite: bool) -> Tuple[bool, float]:
    """(applied, grad_norm). Collective (the norm) whatever the outcome."""
    norm = grad_norm(model)
    if not loss_is_finite or not math.isfinite(norm):
        return False, norm
    if clip > 0.0:
        coeff = clip / (norm + 1e-6)
        if coeff < 1.0:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coeff)
    optimizer.step()
    return True, norm
