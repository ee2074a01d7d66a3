"""Compiled or eager (issue 96): `rollout.enforce_eager` auto weighs the job's decoding against the
compilation's cost on CPU, keeps CUDA graphs on a GPU; a compiling engine keeps its compilation in
the job's folder (rollout/vllm/compile_cache.py). The speeds behind the rule:
benchmarks/bench_rollout_overhead.py (docs/speed.md, "Compiled or eager")."""
import json
import os

import pytest

from verl_hpc.config import load_config
from verl_hpc.config.sections import rollout as section
from verl_hpc.rollout.engine_config import engine_kwargs, model_layers
from verl_hpc.rollout.vllm import compile_cache
from verl_hpc.runtime import device as devices
from verl_hpc.trainer.roles import rollout_options


def test_decode_tokens_counts_every_step_and_each_validations_batch():
    cfg = load_config(None, ["trainer.total_steps=100", "data.train_batch_size=8", "rollout.n=8",
                             "data.max_response_length=24", "trainer.val_every=25", "data.val_batch_size=50"])
    assert cfg.rollout.decode_tokens(cfg) == 100 * 8 * 8 * 24 + 4 * 50 * 24
    cfg = load_config(None, ["trainer.total_steps=100", "data.train_batch_size=8", "rollout.n=8",
                             "data.max_response_length=24", "rollout.max_tokens=16", "trainer.val_every=0"])
    assert cfg.rollout.decode_tokens(cfg) == 100 * 8 * 8 * 16  # the response, not the data's limit


def test_auto_compiles_on_cpu_only_where_the_decoding_pays_for_it():
    r = load_config(None, []).rollout
    fixed, per_layer = section.CPU_COMPILE_S
    pays = int((fixed + per_layer * 30) / (30 * section.CPU_COMPILE_SAVES_S)) + 1  # tokens at 30 layers
    assert not r.eager(gpu=False, decode_tokens=pays, layers=30)  # compiled
    assert r.eager(gpu=False, decode_tokens=pays - 2, layers=30)
    assert r.eager(gpu=False, decode_tokens=pays, layers=2)  # a shallow model saves less per token
    assert r.eager(gpu=False, decode_tokens=10 ** 12, layers=0)  # depth unknown: eager
    assert r.eager(gpu=False)  # nothing known
    for tokens in (0, 10 ** 12):  # a GPU keeps its CUDA graphs whatever the job
        assert not r.eager(gpu=True, decode_tokens=tokens, layers=30)
    for value, want in (("true", True), ("false", False)):  # set by hand: as set, on both machines
        r.enforce_eager = value
        assert {r.eager(gpu, 10 ** 12 * big, 30) for gpu in (True, False) for big in (0, 1)} == {want}


@pytest.mark.parametrize("steps,compiled", [(10, False), (300, False), (1000, True)])
def test_the_engine_gets_the_rule_with_the_jobs_decoding_and_the_models_depth(tmp_path, monkeypatch, steps, compiled):
    """SmolLM2-135M's depth, 8 prompts x 8 samples x 24 tokens: a job of 300 steps stays eager, one of
    1,000 compiles; the compilation goes to the job's folder."""
    monkeypatch.setattr(devices, "has_gpu", lambda: False)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30}))
    assert model_layers(str(tmp_path)) == 30 and model_layers(str(tmp_path / "missing")) == 0
    cfg = load_config(None, [f"model.path={tmp_path}", f"trainer.total_steps={steps}", "data.train_batch_size=8",
                             "rollout.n=8", "data.max_response_length=24", f"trainer.output_dir={tmp_path}/run"])
    kw = engine_kwargs(rollout_options(cfg), "vllm")
    assert kw["enforce_eager"] is not compiled
    assert kw["compile_cache_dir"] == f"{tmp_path}/run/cache/compile"


def test_a_compiling_engine_keeps_its_compilation_in_the_jobs_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_torch_default", lambda: "/tmp/torchinductor_someone")
    env = {}
    kw = compile_cache.prepare(str(tmp_path / "c"), gpu=False, environ=env)
    assert kw == {"compilation_config": {"cache_dir": str(tmp_path / "c" / "vllm")}}
    assert env == {compile_cache.INDUCTOR_CACHE: str(tmp_path / "c" / "inductor"), compile_cache.AOT_COMPILE: "0"}
    # torch's own default written back by torch is not the user's choice; the user's are kept
    env = {compile_cache.INDUCTOR_CACHE: "/tmp/torchinductor_someone/"}
    compile_cache.prepare(str(tmp_path / "c"), gpu=False, environ=env)
    assert env[compile_cache.INDUCTOR_CACHE] == str(tmp_path / "c" / "inductor")
    env = {compile_cache.INDUCTOR_CACHE: "/scratch/mine", compile_cache.AOT_COMPILE: "1"}
    compile_cache.prepare(str(tmp_path / "c"), gpu=False, environ=env)
    assert env == {compile_cache.INDUCTOR_CACHE: "/scratch/mine", compile_cache.AOT_COMPILE: "1"}
    env = {}  # on a GPU vLLM's ahead-of-time artifacts load back: left to vLLM
    compile_cache.prepare(str(tmp_path / "c"), gpu=True, environ=env)
    assert compile_cache.AOT_COMPILE not in env
    env = {}
    assert compile_cache.prepare("", gpu=False, environ=env) == {} and env == {}


def test_torchs_default_cache_folder_is_what_torch_writes_back():
    """The default the module compares with is torch's own (torch writes it into the variable)."""
    from torch._inductor.runtime import cache_dir_utils

    saved = os.environ.pop(compile_cache.INDUCTOR_CACHE, None)
    try:
        assert cache_dir_utils.cache_dir() == compile_cache._torch_default()
        assert os.environ[compile_cache.INDUCTOR_CACHE] == compile_cache._torch_default()
    finally:
        if saved is None:
            os.environ.pop(compile_cache.INDUCTOR_CACHE, None)
        else:
            os.environ[compile_cache.INDUCTOR_CACHE] = saved
