"""Optimizer, LR schedule and the guarded optimizer step of the Megatron engine.

- Adam(W) through `megatron.core.optimizer.get_megatron_optimizer`: the DistributedOptimizer
  (states sharded over data parallel) when `parallel.use_distributed_optimizer`, otherwise
  Megatron's mixed-precision (bf16/fp16) or plain fp32 wrapper. On CPU Megatron picks torch's AdamW,
  which the engine switches to its fused kernel (`use_fused_torch_adam`).
- `OptimizerParamScheduler` for linear warmup (from 0) then constant / linear / cosine decay to
  `min_lr`. The schedule counts *trainer steps* (the role calls `scheduler_step()` once per
  update, as verl does), so `optim.warmup_steps` and `total_steps` are in trainer steps.
- `guarded_step` is ChainedOptimizer.step with two changes: the gradient norm is computed first
  and, when it or the loss is inf/nan, nothing is applied (Megatron checks for inf/nan only with an
  fp16 grad scaler; in bf16/fp32 it would write nan into the weights); and the norm and the clip
  are the engine's own foreach forms of Megatron's (`grad_sq_sum`, `clip_grads`: the same
  gradients, groups and coefficient), whose norm is read to the host together with the step's
  metric sums, once. The trainer skips and counts such steps.
- fp16 (model.dtype = float16): Megatron's DynamicGradScaler scales the loss before the backward
  (`grad_scale_func`), and the step unscales the fp32 main grads and checks them for inf/nan
  (`prepare_grads`, a MAX all-reduce over the model-parallel group). An overflow skips the step:
  weights, Adam's moments and step count stay as they were, and the scale halves (hysteresis 1:
  at every overflow, torch's GradScaler's rule, so that both engines follow one rule; Megatron's
  own default of 2 waits for a second overflow in a row); `optim.loss_scale_window` clean steps
  in a row double it. Its settings are the optim section's (initial_loss_scale, min_loss_scale,
  loss_scale_window). With more than one chained optimizer (an MoE model's expert parameters have
  their own) each has its own scaler: `guarded_step` keeps them equal (`_agree_scalers`).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.fields import choice_problems, range_problems


def check_optim(optim) -> None:
    """The optim section's declared ranges, choices and rules (verl_hpc/config/sections/roles.py),
    for a section the loader did not check: built directly by a test or a benchmark."""
    problems = range_problems(optim, "optim.") + choice_problems(optim, "optim.") + optim.own_problems("optim")
    if problems:
        raise ConfigError("; ".join(problems))


def optimizer_config(optim, dtype, use_distributed_optimizer: bool):
    """Megatron's OptimizerConfig from the job config's `optim` section (OptimConfig)."""
    from megatron.core.optimizer import OptimizerConfig

    check_optim(optim)
    betas = list(optim.betas)
    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=optim.eps, clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer,
        initial_loss_scale=optim.initial_loss_scale, min_loss_scale=optim.min_loss_scale,
        loss_scale_window=optim.loss_scale_window, hysteresis=1)


def build_optimizer(chunks, optim, dtype, use_distributed_optimizer: bool):
    """Megatron's optimizer over the DDP-wrapped chunks; with fp16 the loss is scaled by its
    grad scaler."""
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(optimizer_config(optim, dtype, use_distributed_optimizer), chunks)
    use_fused_torch_adam(optimizer)
    if dtype == torch.float16:
        chunks[0].config.grad_scale_func = optimizer.scale_loss
    return optimizer


def use_fused_torch_adam(optimizer) -> int:
    """Switch torch Adam(W) optimizers under Megatron's wrappers to torch's fused kernel; returns
    how many. Megatron constructs torch's AdamW (where neither Transformer Engine nor apex is
    installed) with torch's defaults, which on CPU loop over the parameters op by op; the fused
    kernel does the same update in one pass per tensor (the weights agree with the loop's to
    rounding). The state (exp_avg, exp_avg_sq, step) is the same, so checkpoints do not care."""
    count = 0
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if type(inner) in (torch.optim.AdamW, torch.optim.Adam) and not any(
                g.get("differentiable") or g.get("capturable") for g in inner.param_groups):
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
            count += 1
    return count


def build_scheduler(optimizer, optim, total_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    check_optim(optim)
    decay_steps = max(int(total_steps), optim.warmup_steps + 1, 1)
    # the config check compares with trainer.total_steps; sft/dpo may run fewer steps (the data
    # ran out first), known only here
    if optim.lr_decay_style != "constant" and optim.warmup_steps >= total_steps:
        raise ConfigError(f"optim.warmup_steps={optim.warmup_steps} must be below trainer.total_steps="
                          f"{total_steps} for lr_decay_style={optim.lr_decay_style!r}")
    wd = optim.weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style, start_wd=wd, end_wd=wd, wd_incr_steps=decay_steps,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True)


def schedule_lr(optim, total_steps: int, step: int) -> float:
    """The LR the scheduler gives after `step` scheduler steps (a pure reference for tests)."""
    max_lr, min_lr, warmup = optim.lr, optim.min_lr, optim.warmup_steps
    decay = max(int(total_steps), warmup + 1, 1)
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if optim.lr_decay_style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if optim.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (max_lr - min_lr)


def current_lr(optimizer) -> float:
    groups = optimizer.param_groups
    return float(groups[0]["lr"]) if groups else 0.0


def grad_scalers(optimizer) -> List[Any]:
    """The fp16 loss scalers of a (chained) Megatron optimizer: one per chained optimizer; [] in
    bf16 / fp32."""
    return [s for s in (getattr(o, "grad_scaler", None) for o in getattr(optimizer, "chained_optimizers", []))
            if s is not None]


def loss_scale(optimizer) -> Optional[float]:
    """The scale the next backward multiplies the loss by; None without a scaler."""
    scalers = grad_scalers(optimizer)
    return float(scalers[0].scale) if scalers else None


def scaler_state(scaler) -> Dict[str, Any]:
    """A DynamicGradScaler's state as plain numbers (the checkpoint meta's `grad_scaler`, the same
    keys the FSDP engine writes: either engine resumes the other's)."""
    return {"scale": float(scaler.scale), "growth_tracker": int(scaler._growth_tracker),
            "hysteresis_tracker": int(scaler._hysteresis_tracker)}


def load_scaler_state(scaler, state: Mapping[str, Any]) -> None:
    """Megatron's own load_state_dict, the scale as the one-element fp32 tensor it keeps (a
    float32 value round-trips exactly through the meta's float)."""
    scaler.load_state_dict({
        "scale": torch.tensor([float(state["scale"])], dtype=torch.float32),
        "growth_tracker": int(state["growth_tracker"]),
        "hysteresis_tracker": int(state.get("hysteresis_tracker", scaler.hysteresis))})


def _agree_scalers(scalers, before: Mapping[str, Any], found_inf: bool) -> None:
    """Each chained optimizer's prepare_grads updated its own scaler from its own parameters'
    overflow, but the loss was scaled by the first one's scale only (ChainedOptimizer.scale_loss):
    they must stay equal. All of them become the state before the step updated by the step's
    overall outcome (the first one, updated with it, is the reference)."""
    load_scaler_state(scalers[0], before)
    scalers[0].update(found_inf)
    state = scaler_state(scalers[0])
    for s in scalers[1:]:
        load_scaler_state(s, state)


def grad_sq_sum(optimizer) -> torch.Tensor:
    """The squared global gradient norm as a 0-d fp32 tensor on the device (no host read): what
    ChainedOptimizer.get_grad_norm sums (each chained optimizer's `get_main_grads_for_grad_norm`:
    no shared or TP-duplicate parameter counted twice, all-reduced over its
    `get_grad_stats_parallel_group`), each optimizer's gradients in one foreach norm. Why not
    Megatron's: it reads the norm to the host itself, and without Transformer Engine or apex its
    fallback l2 norm reads each gradient's norm to the host (one wait for the device per tensor)."""
    total = None
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        grads = opt.get_main_grads_for_grad_norm()
        if grads:
            sq = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float()) ** 2
        else:
            sq = torch.zeros((), dtype=torch.float32, device=_device_of(opt))
        torch.distributed.all_reduce(sq, group=opt.get_grad_stats_parallel_group())
        total = sq if total is None else total + sq
    return total


def _device_of(opt) -> torch.device:
    from verl_hpc.runtime.device import compute_device

    params = opt.get_parameters()
    return params[0].device if params else compute_device()


def clip_grads(optimizer, grad_norm: float) -> None:
    """Each chained optimizer's main gradients times its clip_grad / (norm + 1e-6) where that is
    below 1, in place, one foreach call each (Megatron's clip_grad_by_total_norm_fp32 without TE or
    apex writes `g * coeff` into a new tensor per gradient, then copies it back)."""
    for opt in optimizer.chained_optimizers:
        if getattr(opt, "is_stub_optimizer", False) or not opt.config.clip_grad > 0.0:
            continue
        coeff = opt.config.clip_grad / (grad_norm + 1.0e-6)
        decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        grads = [g for g in ((getattr(p, "decoupled_grad", None) if decoupled else p.grad)
                             for p in opt.get_parameters()) if g is not None]
        if grads and coeff < 1.0:
            torch._foreach_mul_(grads, coeff)


def guarded_step(optimizer, sums: torch.Tensor) -> Tuple[bool, float, bool, List[float]]:
    """(applied, grad_norm, found_inf, sums read): found_inf is the fp16 scaler's overflow (False
    without a scaler). `sums`: the step's metric sums, summed over the ranks and still on the device
    (engines/outputs.py sum_over_ranks, the loss first): read to the host together with the gradient
    norm, the step's one host read before the optimizer's kernels. A non-finite loss or norm applies
    nothing. Collective over the optimizer's groups whatever the outcome."""
    scalers = grad_scalers(optimizer)
    before = scaler_state(scalers[0]) if len(scalers) > 1 else None
    found_inf = bool(optimizer.prepare_grads())  # fp16 grad scaler: unscale + inf check (collective)
    if before is not None:
        _agree_scalers(scalers, before, found_inf)
    sq = grad_sq_sum(optimizer)  # global over TP/PP/DP (collective)
    sq = sq.reshape(1).to(sums.device, torch.float64, non_blocking=True)
    vals = torch.cat([sums.reshape(-1).double(), sq]).tolist()
    sums_read, sq_read = vals[:-1], vals[-1]
    grad_norm = math.sqrt(sq_read) if sq_read >= 0 else float("nan")
    if found_inf or not math.isfinite(sums_read[0]) or not math.isfinite(grad_norm):
        return False, grad_norm, found_inf, sums_read
    clip_grads(optimizer, grad_norm)
    with torch.no_grad():
        optimizer.step_with_ready_grads()
    return True, grad_norm, False, sums_read
