"""fp16 training's dynamic loss scaling in both engines, in fp16 on this CPU (torch 2.13 runs fp16
matmul, SDPA and the fused check-and-unscale on the CPU), one gloo rank, the real engines:

- the Megatron engine (model.dtype = float16: Megatron's Float16Optimizer and DynamicGradScaler)
  and the FSDP engine (fsdp.mixed_precision = fp16: fp16 compute over fp32 master weights, torch's
  ShardedGradScaler on FSDP2's DTensor gradients);
- a step's gradient is unscaled: its norm is the fp32 engine's on the same batch, not 1024 times it;
- an overflow (an inf injected into the gradients, the loss finite) skips the step: weights, Adam's
  moments and step count unchanged bitwise, `overflow` = 1 and `nonfinite` = 0, the scale halved,
  and the LR schedule not advanced; `loss_scale_window` clean steps later the scale has doubled;
- the scaler's state (scale, growth tracker) resumes from an HDF5 checkpoint into a fresh engine
  exactly, and the next step is bitwise the one the saved engine takes (it doubles the scale in
  both: the growth tracker came along);
- the role reports `actor/overflow_steps` and `actor/loss_scale`, and the trainer's guard counts
  overflows apart from non-finite steps.
"""
import dataclasses

import pytest
import torch

from engine_states import make_batch

SCALE = 1024.0
WINDOW = 2


class _InfGrad(torch.autograd.Function):
    """Identity forward, inf/nan backward: an overflowing gradient with a finite loss."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def _loss(out, mb, counts):
    loss = -(out["log_probs"] * mb["response_mask"]).sum() / counts.tokens
    return loss, {"nll": loss.detach()}


def _inf_loss(out, mb, counts):
    return _loss({"log_probs": _InfGrad.apply(out["log_probs"])}, mb, counts)


def _optim(**changes):
    from verl_hpc.config.schema import OptimConfig

    base = dict(lr=1e-2, clip_grad=0.0, lr_decay_style="linear", initial_loss_scale=SCALE,
                loss_scale_window=WINDOW, min_loss_scale=1.0)
    return OptimConfig(**{**base, **changes})


def _engine(kind: str, folder, dtype: str = "float16", **changes):
    from verl_hpc.engines.options import default_options

    o = default_options(str(folder), engine=kind, dtype=dtype, optim=_optim(), micro_batch_size=4, total_steps=10,
                        **changes)
    if kind == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        mp = "fp16" if dtype == "float16" else "fp32"
        return FsdpEngine(dataclasses.replace(o, fsdp=dataclasses.replace(o.fsdp, mixed_precision=mp)))
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)  # idempotent in the one-rank world; torn down by the fixture
    return MegatronEngine(o)


def _local(t):
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _weights(eng):
    params = eng.model.parameters() if hasattr(eng, "model") else eng._parameters()
    return [_local(p).clone() for p in params]


def _optimizer_tensors(eng):
    """Every tensor the optimizer holds: its parameters (Megatron's fp32 master copies) and their
    states (Adam's moments and step)."""
    opt = eng.optimizer
    inners = [o.optimizer for o in opt.chained_optimizers] if hasattr(opt, "chained_optimizers") else [opt]
    out = []
    for inner in inners:
        for g in inner.param_groups:
            for p in g["params"]:
                out.append(_local(p).clone())
                out += [_local(v).clone() for _, v in sorted(inner.state[p].items()) if torch.is_tensor(v)]
    return out


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _scaler(eng) -> dict:
    if hasattr(eng, "scaler"):
        from verl_hpc.engines.fsdp.optim import scaler_state
    else:
        from verl_hpc.engines.megatron.optim import grad_scalers, scaler_state

        return scaler_state(grad_scalers(eng.optimizer)[0])
    return scaler_state(eng.scaler)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("fp16") / "llama", "llama", layers=2)


@pytest.mark.parametrize("kind", ["megatron", "fsdp"])
def test_fp16_gradient_is_unscaled(one_rank_world, folder, kind):
    batch = make_batch(1)
    m16 = _engine(kind, folder).train_step(batch, _loss)
    m32 = _engine(kind, folder, dtype="float32").train_step(batch, _loss)
    assert "loss_scale" not in m32 and "overflow" not in m32  # no scaler outside fp16
    assert m16["loss_scale"] == SCALE and m16["overflow"] == 0.0 and m16["nonfinite"] == 0.0
    assert m16["loss"] == pytest.approx(m32["loss"], rel=1e-3)
    # fp16 rounding of weights and activations, not the factor 1024 a missing unscale leaves
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=2e-2)


@pytest.mark.parametrize("kind", ["megatron", "fsdp"])
def test_overflow_skips_the_step_halves_the_scale_and_it_grows_back(one_rank_world, folder, kind):
    eng = _engine(kind, folder)
    assert eng.train_step(make_batch(1), _loss)["loss_scale"] == SCALE  # one clean step: Adam has state
    eng.scheduler_step()
    weights, states, lr, applied = _weights(eng), _optimizer_tensors(eng), eng.lr, eng.steps_applied

    m = eng.train_step(make_batch(2), _inf_loss)
    assert m["overflow"] == 1.0 and m["nonfinite"] == 0.0 and m["loss_scale"] == SCALE / 2, m
    assert eng.steps_applied == applied
    assert _equal(_weights(eng), weights), "the skipped step changed a weight"
    assert _equal(_optimizer_tensors(eng), states), "the skipped step changed the optimizer's state"
    assert _scaler(eng)["growth_tracker"] == 0
    assert eng.scheduler_step() == lr, "a skipped update advanced the LR schedule"

    scales = [eng.train_step(make_batch(3 + k), _loss)["loss_scale"] for k in range(WINDOW)]
    assert scales == [SCALE / 2, SCALE], "the scale doubles after loss_scale_window clean steps"
    assert eng.steps_applied == applied + WINDOW and not _equal(_weights(eng), weights)
    assert eng.scheduler_step() < lr  # an update with an applied step moves the (linear) schedule on


@pytest.mark.parametrize("kind", ["megatron", "fsdp"])
def test_scaler_state_resumes_bitwise(one_rank_world, folder, kind, tmp_path):
    from verl_hpc.checkpoint import load_into, read_metadata, save_checkpoint

    eng = _engine(kind, folder)
    for k, loss in enumerate((_loss, _inf_loss, _loss)):  # scale 1024 -> 512, growth tracker 1
        eng.train_step(make_batch(10 + k), loss)
    saved = _scaler(eng)
    assert (saved["scale"], saved["growth_tracker"]) == (SCALE / 2, 1)
    st = eng.state()
    assert st.meta["grad_scaler"] == saved
    ckpt = save_checkpoint(tmp_path / "ckpt", eng.steps_applied, st.tensors, metadata={"engine": st.meta})

    fresh = _engine(kind, folder)
    assert _scaler(fresh)["scale"] == SCALE
    meta = read_metadata(ckpt)["engine"]
    fresh.load_state(lambda targets: load_into(ckpt, targets), meta)
    assert _scaler(fresh) == saved
    assert _equal(_weights(fresh), _weights(eng)) and _equal(_optimizer_tensors(fresh), _optimizer_tensors(eng))
    a, b = eng.train_step(make_batch(20), _loss), fresh.train_step(make_batch(20), _loss)
    assert a["loss_scale"] == b["loss_scale"] == SCALE, "the growth tracker did not resume"
    assert _equal(_weights(fresh), _weights(eng)), "the resumed engine's next step differs"


def test_role_and_guard_report_overflows(one_rank_world, folder):
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.roles import Actor
    from verl_hpc.trainer.hooks.guard import NonFiniteGuard

    actor = Actor(_engine("megatron", folder), ActorConfig(ppo_mini_batch_size=4, ppo_epochs=2))
    m = actor.update(make_batch(1), _inf_loss)  # 2 epochs x 2 mini-batches, every step overflows
    assert m["actor/overflow_steps"] == 4.0 and m["actor/nonfinite_steps"] == 0.0
    assert m["actor/loss_scale"] == SCALE / 16
    assert actor.engine.lr == pytest.approx(1e-2), "an update without an applied step moved the schedule"
    guard = NonFiniteGuard(max_in_a_row=1)
    assert guard.check(m, step=1) == {"train/nonfinite_steps_total": 0.0, "train/nonfinite_in_a_row": 0.0,
                                      "train/overflow_steps_total": 4.0}
    assert guard.check(m, step=2)["train/overflow_steps_total"] == 8.0  # overflows do not stop the run
    resumed = NonFiniteGuard(max_in_a_row=1)
    resumed.load_state_dict(guard.state_dict())
    assert resumed.overflow_total == 8


def test_chained_scalers_agree_after_one_of_them_overflowed(one_rank_world):
    """An MoE model's expert parameters have a chained optimizer, and a scaler, of their own; the
    loss is scaled by the first one's scale only. When only one of them saw an overflow, both must
    take the step's outcome: halved, trackers reset, still equal (megatron/optim.py _agree_scalers)."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    from verl_hpc.engines.megatron.optim import _agree_scalers, scaler_state
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)  # cpu_compat: the scalers' tensors on the CPU
    scalers = [DynamicGradScaler(initial_scale=SCALE, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=WINDOW, hysteresis=1) for _ in range(2)]
    for s in scalers:
        s.update(False)  # one clean step each: growth tracker 1
    before = scaler_state(scalers[0])
    scalers[0].update(False)  # what their own prepare_grads did: the dense part was finite (and grew),
    scalers[1].update(True)  # the experts' overflowed
    assert scaler_state(scalers[0]) != scaler_state(scalers[1])
    _agree_scalers(scalers, before, found_inf=True)
    assert scaler_state(scalers[0]) == scaler_state(scalers[1]) == {
        "scale": SCALE / 2, "growth_tracker": 0, "hysteresis_tracker": 0}
