"""fsdp.compile (engines/fsdp/build.py compile_choice): true / false / null (auto: on with a GPU
and Triton, off on a CPU); the default stays false until a GPU run measures it. On CPU with the
device stubbed: the choice per machine, the refusals, the config accepting null, and the sharded
model's decoder layers compiled exactly when the choice says so."""
import pytest
import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.fsdp import build


@pytest.mark.parametrize("setting, gpu, triton, cxx, on", [
    (None, True, True, True, True),     # auto on a GPU with Triton
    (None, True, False, True, False),   # auto without Triton: off, not an error
    (None, False, False, True, False),  # auto on a CPU: off
    (False, True, True, True, False),
    (True, True, True, False, True),
    (True, False, False, True, True),   # true on a CPU with a C++ compiler
])
def test_compile_choice_per_machine(setting, gpu, triton, cxx, on):
    got, why = build.compile_choice(setting, gpu=gpu, triton=triton, cxx=cxx)
    assert got is on and why.startswith("fsdp.compile = ")


def test_true_where_the_compiler_is_missing_is_refused_by_name():
    with pytest.raises(ConfigError, match="fsdp.compile = true needs Triton on GPUs"):
        build.compile_choice(True, gpu=True, triton=False, cxx=True)
    with pytest.raises(ConfigError, match="fsdp.compile = true needs a C\\+\\+ compiler"):
        build.compile_choice(True, gpu=False, triton=True, cxx=False)


def test_config_default_is_off_and_null_is_auto():
    from verl_hpc.config import load_config

    assert load_config(None, []).fsdp.compile is False
    cfg = load_config(None, ["fsdp.compile=null", "parallel.engine=fsdp"])
    assert cfg.fsdp.compile is None and not [p for p in cfg.fsdp.check(cfg) if "compile" in p]


@pytest.mark.parametrize("gpu, compiled", [(True, True), (False, False)])
def test_auto_compiles_the_decoder_layers_only_on_a_gpu(one_rank_world, monkeypatch, gpu, compiled):
    """shard_model with fsdp.compile = auto and the device stubbed: each decoder layer's
    nn.Module.compile() (lazy: nothing compiles until a forward) on a GPU, none on a CPU."""
    import importlib.util
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from verl_hpc.models.tiny import hf_config

    monkeypatch.setattr(build, "has_gpu", lambda: gpu)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real_find(name, *a))
    model = AutoModelForCausalLM.from_config(hf_config("llama", layers=2, vocab_size=64, hidden=16, heads=2,
                                                       kv_heads=1, head_dim=8, ffn=32, max_positions=32))
    fsdp = SimpleNamespace(compile=None, reshard_after_forward=True, cpu_offload=False, shard_size=0)
    mesh = build.make_mesh(fsdp, torch.device("cpu"))
    units = build.shard_units(model)
    build.shard_model(model, mesh, fsdp, torch.float32, activation_checkpointing=False)
    assert len(units) == 2
    assert all((getattr(u, "_compiled_call_impl", None) is not None) is compiled for u in units)
