"""LR warmup and decay values, and the megatron-core behaviour the exact loss scaling relies on."""
import inspect
import math
import types

import pytest
import torch

from verl_hpc.config.schema import OptimConfig
from verl_hpc.engines.megatron.optim import build_scheduler, schedule_lr


class _Opt:
    """What OptimizerParamScheduler touches: param_groups."""

    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def _lrs(optim, total, steps):
    opt = _Opt()
    sched = build_scheduler(opt, optim, total)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step(increment=1)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_warmup_then_linear_decay():
    optim = OptimConfig(lr=1.0, warmup_steps=2, lr_decay_style="linear", min_lr=0.1)
    assert _lrs(optim, 10, 12) == pytest.approx(
        [0.0, 0.5, 1.0] + [0.1 + 0.9 * (1 - k / 8) for k in range(1, 9)] + [0.1, 0.1])


def test_cosine_decay_without_warmup():
    optim = OptimConfig(lr=2.0, lr_decay_style="cosine", min_lr=0.0)
    got = _lrs(optim, 4, 4)
    assert got == pytest.approx([2.0 * 0.5 * (math.cos(math.pi * k / 4) + 1) for k in range(5)])


def test_constant_with_warmup_and_the_reference_formula():
    optim = OptimConfig(lr=0.3, warmup_steps=3)
    got = _lrs(optim, 5, 6)
    assert got == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3])
    for style in ("constant", "linear", "cosine"):
        o = OptimConfig(lr=0.7, warmup_steps=2, lr_decay_style=style, min_lr=0.05)
        assert _lrs(o, 9, 11) == pytest.approx([schedule_lr(o, 9, k) for k in range(12)])


def test_bad_schedules_name_the_field():
    with pytest.raises(ValueError, match="optim.warmup_steps=10 must be below trainer.total_steps=10"):
        build_scheduler(_Opt(), OptimConfig(warmup_steps=10, lr_decay_style="linear"), 10)
    with pytest.raises(ValueError, match="optim.min_lr"):
        build_scheduler(_Opt(), OptimConfig(lr=0.1, min_lr=0.2), 10)
    # the section's declared checks, for a section the loader never saw
    with pytest.raises(ValueError, match=r"optim.warmup_steps: must be >= 0, got -1"):
        build_scheduler(_Opt(), OptimConfig(warmup_steps=-1), 10)
    with pytest.raises(ValueError, match="optim.lr_decay_style.*'step'.*constant, linear, cosine"):
        build_scheduler(_Opt(), OptimConfig(lr_decay_style="step"), 10)


def test_megatron_does_not_rescale_a_per_token_loss_3_tuple():
    """schedule.py's exactness argument, pinned: with calculate_per_token_loss the schedule
    neither divides by num_microbatches nor by num_tokens (a new megatron-core must be re-checked)."""
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    cfg = types.SimpleNamespace(calculate_per_token_loss=True, timers=None)
    store = []
    loss = torch.tensor(0.75)
    out, n = forward_step_calc_loss(None, torch.zeros(1), lambda o: (loss, torch.tensor(5), {"m": 1}),
                                    cfg, None, False, 4, store, cp_group_size=1, is_last_stage=True)
    assert float(out) == 0.75 and int(n) == 5 and store == [{"m": 1}]
    cfg.calculate_per_token_loss = False  # what it would have done otherwise
    out, _ = forward_step_calc_loss(None, torch.zeros(1), lambda o: (torch.tensor(0.75), torch.tensor(5), {}),
                                    cfg, None, False, 4, store, cp_group_size=1, is_last_stage=True)
    assert float(out) == pytest.approx(0.75 / 5 / 4)


def test_megatron_ddp_sums_gradients_for_per_token_losses():
    """DDP's gradient scaling factor is 1.0 (a plain SUM over data parallel) with
    calculate_per_token_loss, and finalize_model_grads divides only when given num_tokens."""
    import importlib

    ddp = importlib.import_module("megatron.core.distributed.distributed_data_parallel")
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    src = inspect.getsource(ddp.DistributedDataParallel.__init__)
    branch = src[src.index("if config.calculate_per_token_loss:"):]
    assert branch.index("gradient_scaling_factor = 1.0") < branch.index("else:")
    src = inspect.getsource(fmg.finalize_model_grads)
    assert "if num_tokens is not None:" in src and "scale_gradients" in src


def test_torch_adam_under_megatron_wrappers_runs_fused_with_the_loops_results():
    import types

    import torch

    from verl_hpc.engines.megatron.optim import use_fused_torch_adam

    def run(fused: bool):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(5))]
        start = torch.cat([p.detach().flatten() for p in params])
        inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=inner)])
        if fused:
            assert use_fused_torch_adam(chained) == 1
            assert all(g["fused"] for g in inner.param_groups)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            inner.step()
        return start, torch.cat([p.detach().flatten() for p in params]), inner.state[params[0]]

    (start, loop, loop_state), (_, fused, fused_state) = run(False), run(True)
    assert float((loop - start).abs().max()) > 1e-2  # the steps moved the weights
    torch.testing.assert_close(fused, loop, rtol=1e-6, atol=1e-6)
    assert sorted(fused_state) == sorted(loop_state)  # same state: checkpoints do not care
    assert use_fused_torch_adam(types.SimpleNamespace(optimizer=object())) == 0
