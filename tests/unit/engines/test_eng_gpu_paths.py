"""GPU-only paths of the Megatron engine, checked on CPU where their logic can run (issue: GPU
paths that have never run): fp8 wiring, the fused-Adam step layout on resume, sequence parallel
without Transformer Engine, kernel/overlap switches, the collective timeout of Megatron's groups."""
import datetime
import types

import pytest
import torch

from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.config.schema import choices_of
from verl_hpc.engines.megatron import build as build_mod
from verl_hpc.engines import options as options_mod
from verl_hpc.engines.megatron import state as state_mod
from verl_hpc.engines.options import check_options, default_options
from verl_hpc.engines.megatron.kernels import Availability, KernelSwitches, PerfOptions
from verl_hpc.trainer.roles import engine_options
from verl_hpc.models import gpt as gpt_mod
from verl_hpc.models.config_mapping import parse_hf_config


ARCH = parse_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                        "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2})


def _cfg(*overrides):
    return load_config(None, ["model.path=/m", *overrides])


# ------------------------------------------------------------------------------------- fp8 (2)
def test_model_fp8_reaches_the_engine_options():
    assert not engine_options(_cfg(), "actor").fp8
    for role in ("actor", "ref", "critic"):
        o = engine_options(_cfg("model.fp8=true", "model.fp8_recipe=tensorwise"), role)
        assert o.fp8 and o.fp8_recipe == "tensorwise", role
    assert not engine_options(_cfg("model.fp8=true"), "actor", fp8=False).fp8  # explicit keyword wins


def test_fp8_sets_megatron_transformer_config_fields():
    plain = gpt_mod.gpt_transformer_config(ARCH, 1, 1)
    assert plain.fp8 is None
    cfg = gpt_mod.gpt_transformer_config(ARCH, 1, 1, fp8=True, fp8_recipe="tensorwise")
    assert cfg.fp8 == "hybrid" and cfg.fp8_recipe == "tensorwise"
    with pytest.raises(ValueError, match="fp8=True needs fp8_recipe"):
        gpt_mod.gpt_transformer_config(ARCH, 1, 1, fp8=True)


def test_engine_passes_fp8_and_recipe_to_the_model_builder(monkeypatch):
    """build_chunks hands options.fp8/fp8_recipe to build_gpt_model; what that builder makes of
    them is the TransformerConfig of the test above (the model itself needs TE + a GPU)."""
    import megatron.core.parallel_state as ps

    seen = {}

    class Stop(Exception):
        pass

    def fake_build(arch, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(build_mod, "build_gpt_model", fake_build)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: None)
    monkeypatch.setattr(build_mod, "engine_arch", lambda o: ARCH)
    options = engine_options(_cfg("model.fp8=true", "model.fp8_recipe=mxfp8"), "actor")
    with pytest.raises(Stop):
        build_mod.build_chunks(options, torch.float32, False, PerfOptions())
    assert seen["fp8"] is True and seen["fp8_recipe"] == "mxfp8"
    config = gpt_mod.gpt_transformer_config(ARCH, 1, 1, **{k: v for k, v in seen.items() if k != "vp_stage"})
    assert (config.fp8, config.fp8_recipe) == ("hybrid", "mxfp8")


def test_fp8_without_gpu_or_te_fails_with_the_documented_error(monkeypatch):
    opts = default_options(model_path="/m", trainable=False, fp8=True)
    with pytest.raises(ConfigError, match="model.fp8=true needs a CUDA GPU"):
        check_options(opts)
    monkeypatch.setattr(gpt_mod, "has_gpu", lambda: True)
    monkeypatch.setattr(gpt_mod, "transformer_engine_available", lambda: False)
    with pytest.raises(ConfigError, match="model.fp8=true needs transformer_engine"):
        check_options(opts)
    with pytest.raises(ConfigError, match="model.fp8_recipe: 'custom'"):
        gpt_mod.check_fp8_supported("custom")


def test_fp8_recipes_are_the_config_choices():
    assert set(choices_of("model.fp8_recipe")) == set(gpt_mod.FP8_RECIPES)


# ------------------------------------------------------------------- sequence parallel (5)
def test_sequence_parallel_without_te_is_refused(monkeypatch):
    opts = default_options(model_path="/m", trainable=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=true needs the Transformer Engine"):
        check_options(opts)  # CPU
    monkeypatch.setattr(options_mod, "has_gpu", lambda: True)
    monkeypatch.setattr(options_mod, "transformer_engine_available", lambda: False)
    with pytest.raises(ValueError, match="torch norm"):
        check_options(opts)  # GPU, local spec
    monkeypatch.setattr(options_mod, "transformer_engine_available", lambda: True)
    check_options(opts)  # GPU + TE: fine


def test_sequence_parallel_in_a_cpu_job_is_refused_by_validation():
    cfg = load_config(None, ["trainer.job=smoke", "parallel.tp=2", "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match="parallel.sequence_parallel needs the Transformer Engine"):
        validate(cfg, check_model=False)
    cfg = load_config(None, ["trainer.job=smoke", "parallel.tp=2", "parallel.sequence_parallel=true",
                                 "slurm.gpus_per_node=2"])
    validate(cfg, check_model=False)


# ------------------------------------------------------------- kernels and overlap (8)
NONE = Availability(gpu=False, te=False, grad_accum_ext=False)
GPU = Availability(gpu=True, te=False, grad_accum_ext=False)
FULL = Availability(gpu=True, te=True, grad_accum_ext=True)


def test_auto_switches_follow_the_kernels_present():
    auto = KernelSwitches()
    assert auto.resolve(trainable=True, use_distributed_optimizer=True, available=NONE) == PerfOptions()
    assert Availability.detect() == NONE  # this CPU machine: nothing changes on CPU
    on = auto.resolve(trainable=True, use_distributed_optimizer=True, available=FULL)
    assert on == PerfOptions(True, True, True, True, True, True)
    gpu = auto.resolve(trainable=True, use_distributed_optimizer=False, available=GPU)
    assert gpu == PerfOptions(bias_activation_fusion=True, overlap_grad_reduce=True, cross_entropy_loss_fusion=True)
    frozen = auto.resolve(trainable=False, use_distributed_optimizer=True, available=FULL)
    assert frozen == PerfOptions(bias_activation_fusion=True, apply_rope_fusion=True, cross_entropy_loss_fusion=True)


def test_explicit_switches():
    off = KernelSwitches(False, False, False, False, False, False)
    assert off.resolve(trainable=True, use_distributed_optimizer=True, available=FULL) == PerfOptions()
    with pytest.raises(ValueError, match="model.apply_rope_fusion=true needs a CUDA GPU and Transformer Engine"):
        KernelSwitches(apply_rope_fusion=True).resolve(trainable=True, use_distributed_optimizer=True,
                                                       available=GPU)
    with pytest.raises(ValueError, match="parallel.overlap_param_gather=true needs"):
        KernelSwitches(overlap_param_gather=True).resolve(trainable=True, use_distributed_optimizer=False,
                                                          available=FULL)


def test_switches_come_from_the_config_and_reach_megatron():
    cfg = _cfg("model.apply_rope_fusion=false", "parallel.overlap_grad_reduce=true")
    sw = engine_options(cfg, "actor").kernels
    assert sw == KernelSwitches(apply_rope_fusion=False, overlap_grad_reduce=True)
    perf = PerfOptions(bias_activation_fusion=True)
    tc = gpt_mod.gpt_transformer_config(ARCH, 1, 1, **perf.transformer_overrides())
    assert tc.bias_activation_fusion and not tc.apply_rope_fusion and not tc.gradient_accumulation_fusion


def test_overlap_runs_on_cpu_when_asked_and_auto_keeps_it_to_gpus():
    """The overlaps need no kernel (asynchronous collectives; gloo has them): `true` is valid on a
    CPU job and reaches Megatron there, auto leaves them off without a GPU."""
    on = KernelSwitches(overlap_grad_reduce=True, overlap_param_gather=True)
    assert on.resolve(trainable=True, use_distributed_optimizer=True, available=NONE) == PerfOptions(
        overlap_grad_reduce=True, overlap_param_gather=True)
    validate(load_config(None, ["trainer.job=smoke", "parallel.overlap_grad_reduce=true",
                                "parallel.overlap_param_gather=true"]), check_model=False)


def test_gpu_only_switches_refused_in_a_cpu_job():
    cfg = load_config(None, ["trainer.job=smoke", "model.bias_activation_fusion=true"])
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_model=False)
    text = str(info.value)
    assert "model.bias_activation_fusion = true needs GPUs" in text
    cfg = load_config(None, ["trainer.job=smoke", "slurm.gpus_per_node=2", "parallel.use_distributed_optimizer=false",
                             "parallel.overlap_param_gather=true"])
    with pytest.raises(ConfigError, match="needs parallel.use_distributed_optimizer = true"):
        validate(cfg, check_model=False)


# ------------------------------------------------------------------ fused-Adam resume (3)
class FusedStyleAdam(torch.optim.Optimizer):
    """Adam that keeps its step count the way TE's and apex's FusedAdam do: one int per param
    group, created by the first step(); per-parameter state holds only the moments."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            b1, b2 = g["betas"]
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m = st["exp_avg"] / (1 - b1 ** g["step"])
                v = st["exp_avg_sq"] / (1 - b2 ** g["step"])
                p.sub_(g["lr"] * m / (v.sqrt() + g["eps"]))


def _megatron_like(inner):
    """The shape of a Megatron ChainedOptimizer that state.py reads (init_state_fn: Megatron's
    creation of the moments before a load)."""
    def init_state_fn(opt, config=None):
        for g in opt.param_groups:
            for p in g["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)

    return types.SimpleNamespace(chained_optimizers=[
        types.SimpleNamespace(optimizer=inner, init_state_fn=init_state_fn, config=None)])


GRADS = [torch.randn(3, 5, generator=torch.Generator().manual_seed(k)) for k in range(6)]


def _run(opt, param, grads):
    for g in grads:
        param.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("layout", ["fused", "torch"])
def test_resume_restores_the_step_count_bitwise(layout):
    make = (lambda ps: FusedStyleAdam(ps)) if layout == "fused" else (lambda ps: torch.optim.Adam(ps, lr=1e-2))
    start = torch.randn(3, 5, generator=torch.Generator().manual_seed(99))
    ref = torch.nn.Parameter(start.clone())
    _run(make([ref]), ref, GRADS)  # 6 steps without interruption

    def resumed(restore_step: bool):
        a = torch.nn.Parameter(start.clone())
        first = _megatron_like(make([a]))
        _run(first.chained_optimizers[0].optimizer, a, GRADS[:4])
        step = state_mod.optimizer_step_count(first)
        assert step == 4
        inner = first.chained_optimizers[0].optimizer
        moments = {k: inner.state[a][k].clone() for k in ("exp_avg", "exp_avg_sq")}
        b = torch.nn.Parameter(a.detach().clone())  # "checkpoint" -> new process
        second = _megatron_like(make([b]))
        state_mod.ensure_optimizer_state(second)
        inner2 = second.chained_optimizers[0].optimizer
        for k, v in moments.items():
            inner2.state[b][k].copy_(v)
        if restore_step:
            state_mod.set_optimizer_step_count(second, step)
            assert state_mod.optimizer_step_count(second) == 4
        _run(inner2, b, GRADS[4:])
        return b

    assert torch.equal(resumed(True), ref)
    if layout == "fused":  # without restoring group["step"], bias correction restarts: differs
        assert not torch.equal(resumed(False), ref)


def test_fresh_fused_optimizer_gets_no_step_entry():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = _megatron_like(FusedStyleAdam([p]))
    state_mod.ensure_optimizer_state(opt)
    state_mod.set_optimizer_step_count(opt, 0)
    assert "step" not in opt.chained_optimizers[0].optimizer.param_groups[0]
    assert state_mod.optimizer_step_count(opt) == 0


# ------------------------------------------------------------- collective timeout (9)
def test_collective_timeout_reaches_megatrons_groups(one_rank_world, monkeypatch):
    import torch.distributed as dist

    from verl_hpc.parallel import init_from_config

    timeouts = []
    real_new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        # megatron-core 0.16.1 creates the expert-data-parallel gloo twin without its timeout
        # (torch's default then); dense models never communicate on it.
        if kwargs.get("group_desc") != "EXPERT_DATA_PARALLEL_GROUP_GLOO":
            timeouts.append(kwargs.get("timeout"))
        return real_new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording_new_group)
    cfg = load_config(None, ["trainer.collective_timeout_s=42"])
    init_from_config(cfg.parallel, seed=1, timeout_s=cfg.trainer.collective_timeout_s)
    assert len(timeouts) >= 6  # TP, PP, DP, CP, model-parallel, embedding, ... and gloo twins
    assert set(timeouts) == {datetime.timedelta(seconds=42)}, set(timeouts)


def test_build_engine_passes_the_trainer_timeout(monkeypatch):
    import megatron.core.parallel_state as ps
    import torch.distributed as dist

    from verl_hpc.engines.megatron import roles
    from verl_hpc.trainer.roles import build_engine

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(parallel_cfg, seed=1, timeout_s=None):
        seen.update(timeout_s=timeout_s)
        raise Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(roles, "init_from_config", fake_init)
    with pytest.raises(Stop):
        build_engine("actor", _cfg("trainer.collective_timeout_s=77"))
    assert seen == {"timeout_s": 77}


# --------------------------------------------------------- fp8 token alignment (issue 27, 3)
def _engine_until_build(monkeypatch, options, tp):
    """A MegatronEngine's __init__ up to its model build (which needs TE + a GPU for fp8): the
    padding it chose, on a faked Megatron layout of `tp` ranks."""
    import megatron.core.parallel_state as ps

    from verl_hpc.engines.megatron import engine as engine_mod
    from verl_hpc.engines.megatron import wiring

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    for name, value in [("model_parallel_is_initialized", True), ("get_tensor_model_parallel_world_size", tp),
                        ("get_pipeline_model_parallel_world_size", 1),
                        ("get_virtual_pipeline_model_parallel_world_size", None),
                        ("get_data_parallel_world_size", 1), ("get_data_parallel_rank", 0)]:
        monkeypatch.setattr(ps, name, lambda *a, v=value, **k: v)
    monkeypatch.setattr(wiring, "check_options", lambda o: None)  # fp8 refuses CPU (tested above)
    monkeypatch.setattr(wiring, "build_chunks", stop)
    monkeypatch.setattr(wiring, "engine_arch", lambda o: None)  # the VLM layout check reads the (absent) folder
    monkeypatch.setattr(wiring.vision_lib, "check_layout", lambda *a, **k: None)
    monkeypatch.setattr(wiring, "shard_optimizer", lambda o: False)  # no world
    eng = engine_mod.MegatronEngine.__new__(engine_mod.MegatronEngine)
    with pytest.raises(Stop):
        eng.__init__(options)
    return eng


@pytest.mark.parametrize("recipe, align", [("mxfp8", 32), ("delayed", 16), ("tensorwise", 16),
                                           ("blockwise", 16)])
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_micro_batches_are_padded_to_the_recipes_alignment(monkeypatch, recipe, align, tp):
    """TE's MXFP8 quantizer needs token counts divisible by 32 (Megatron: get_fp8_align_size); the
    engine padded every recipe to 16. Real and dummy micro-batches follow the recipe."""
    from verl_hpc.engines.megatron.schedule import MicroBatch

    sp = tp > 1
    options = engine_options(_cfg("model.fp8=true", f"model.fp8_recipe={recipe}",
                                             f"parallel.tp={tp}", f"parallel.sequence_parallel={sp}"), "actor")
    eng = _engine_until_build(monkeypatch, options, tp)
    assert eng.pad_seq_to == align * tp
    batch = {"input_ids": torch.ones(3, 37, dtype=torch.long), "prompt_lengths": torch.full((3,), 7),
             "response_lengths": torch.full((3,), 30), "response_mask": torch.ones(3, 30)}
    real = MicroBatch(batch, [0, 1, 2], "cpu", eng.pad_seq_to)
    dummy = MicroBatch(batch, [], "cpu", eng.pad_seq_to)
    assert real.shape[1] % (align * tp) == 0 and real.shape[1] >= 37
    assert dummy.shape == (1, align * tp)


def test_without_fp8_nothing_is_padded_beyond_sequence_parallel(monkeypatch):
    assert gpt_mod.token_alignment(False, "mxfp8") == 1
    options = engine_options(_cfg("parallel.tp=2", "parallel.sequence_parallel=true"), "actor")
    assert _engine_until_build(monkeypatch, options, 2).pad_seq_to == 2
