"""model.dtype = float16 in the config: a CPU job takes it where torch's CPU float16 kernels exist
(torch 2.13 here: the fp16 engine tests run on them) and is refused, one line naming model.dtype,
where they do not; the engines refuse alike on a machine without a GPU; the loss-scale fields'
rule. The probe is replaced where a kernel must look missing (this torch has all of them)."""
import dataclasses

import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config import float16
from verl_hpc.engines import options as options_lib

import config_checks

CPU = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2", "slurm.gpus_per_node=0", "model.dtype=float16"]


def problems(overrides) -> list:
    return config_checks.found(*overrides)  # [] when validate accepts them


def test_this_torch_runs_float16_on_the_cpu():
    assert float16.cpu_float16_missing() == ""
    assert problems(CPU) == []


def test_a_cpu_job_without_the_kernels_is_refused_naming_model_dtype(monkeypatch):
    monkeypatch.setattr(float16, "cpu_float16_missing", lambda: "matmul")
    (p,) = problems(CPU)
    assert p.startswith("model.dtype = float16 on a CPU job (slurm.gpus_per_node = 0) needs torch's CPU float16")
    assert "has no matmul" in p and "valid: model.dtype=float32" in p and "\n" not in p
    assert problems(CPU[:-1] + ["model.dtype=bfloat16"]) == []  # the rule is fp16's only
    assert problems(CPU[:-1] + ["model.dtype=float16", "slurm.gpus_per_node=8"]) == []  # GPUs: no probe


def test_the_engines_refuse_alike_without_a_gpu(monkeypatch):
    monkeypatch.setattr(float16, "cpu_float16_missing", lambda: "scaled_dot_product_attention")
    monkeypatch.setattr(options_lib, "has_gpu", lambda: False)
    opts = options_lib.default_options("/m", dtype="float16")
    with pytest.raises(ConfigError, match=r"^model.dtype = float16 on a machine without a GPU needs .* has no "
                                          r"scaled_dot_product_attention"):
        options_lib.check_options(opts)
    options_lib.check_options(dataclasses.replace(opts, dtype="bfloat16"))
    from verl_hpc.engines.fsdp.engine import check_fsdp_options

    fsdp = dataclasses.replace(opts, engine="fsdp", dtype="float32")
    check_fsdp_options(fsdp)  # auto computes in fp32 on a CPU: nothing in fp16
    with pytest.raises(ConfigError, match=r"^fsdp.mixed_precision = fp16 on a machine without a GPU .* valid: "
                                          r"fsdp.mixed_precision=auto"):
        check_fsdp_options(dataclasses.replace(fsdp, fsdp=dataclasses.replace(fsdp.fsdp, mixed_precision="fp16")))


def test_loss_scale_fields():
    (p,) = problems(CPU + ["actor.optim.initial_loss_scale=4", "actor.optim.min_loss_scale=8"])
    assert p == "actor.optim.min_loss_scale = 8 is above actor.optim.initial_loss_scale = 4"
    (p,) = problems(CPU + ["critic.optim.loss_scale_window=0"])
    assert p.startswith("critic.optim.loss_scale_window: must be > 0")
    cfg = load_config(None, CPU)
    assert (cfg.actor.optim.initial_loss_scale, cfg.actor.optim.min_loss_scale,
            cfg.actor.optim.loss_scale_window) == (65536.0, 1.0, 1000)
