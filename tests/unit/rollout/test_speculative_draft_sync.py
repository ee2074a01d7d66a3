"""rollout.speculative.draft_layers: a drafter cut from the policy's first layers, kept in step by the
weight sync (verl_hpc/rollout/speculative/draft_sync.py), against the same drafter frozen and against no
speculation. Three engines on a tiny Llama of 4 layers whose last two add little to the residual
stream (their output projections x DAMP: a stand-in for a model whose early exit is a useful
drafter, its later layers refining; on the random 2-layer tiny model a drafter of its first layer
had 3% of its greedy proposals accepted). The drafter is layers 0-1 with the policy's embedding,
norm and head:
- before the policy moves, both drafters propose alike and greedy output is the plain engine's;
- after a weight sync that moves every tensor: the synced drafter's parameters, read back from
  vLLM's draft model, are the target's first-layer ones (the frozen drafter's are not: the check
  fails if the drafter is not synced), its acceptance stays near its own before, the frozen one's
  falls, greedy tokens and log-probs are the plain engine's, and sampled log-probs the moved
  policy's own;
- the frozen drafter is re-sent by every sync (a level-2 sleep drops it on a GPU): its weights,
  scribbled over before the sync as a dropped pool's may be, read back as its folder's after it.
"""
import pytest
import torch
from rol_helpers import TOL, load_hf, max_diff, prompts_of_lengths, teacher_forced_logprobs

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.speculative import SpeculativeConfig, drafter_names
from verl_hpc.resharding.mtp import MtpWeights
from verl_hpc.resharding.sync import WeightSync
from verl_hpc.rollout.speculative import draft_sync
from verl_hpc.rollout.speculative import drafter as vllm_drafter
from verl_hpc.rollout.sampling import default_spec
from verl_hpc.rollout.weights import checkpoint_weight_names

MAX_PROMPT, MAX_NEW, LAYERS, N = 200, 48, 4, 2
PROMPTS = prompts_of_lengths(3, 17, 64, 9, 30, 5, seed=1)
GREEDY = default_spec(temperature=0, max_tokens=24)
DAMP = 0.1  # the layers past the drafter's: their o_proj and down_proj scaled by it
SCALE = 1.0  # the policy's move: noise on every tensor, of SCALE x that tensor's own std


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from verl_hpc.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("early_exit") / "llama", "llama", layers=LAYERS)
    state = load_file(f"{path}/model.safetensors")
    for k in state:
        if any(k.startswith(f"model.layers.{i}.") for i in range(N, LAYERS)) and k.endswith(("o_proj.weight",
                                                                                            "down_proj.weight")):
            state[k] = state[k] * DAMP
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    return str(path)


def moved_state(path, seed=11):
    """Every tensor of the policy moved by noise as large as the tensor's own spread (the damped layers
    stay damped: the move keeps the model's shape of a trained one)."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(f"{path}/model.safetensors")
    return {k: v + SCALE * v.std() * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}


def _engine(path, speculative=None):
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    return VLLMRollout(path, speculative=speculative, disable_log_stats=False,
                       **default_engine_args("vllm", max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW))


pytestmark = pytest.mark.usefixtures("no_default_group_left")  # tests/unit/conftest.py


@pytest.fixture(scope="module")
def engines(policy, tmp_path_factory):
    """plain, kept (draft_layers = N) and frozen (the same first-N-layers drafter as a folder)."""
    folder = tmp_path_factory.mktemp("frozen_drafter")
    draft_sync.write_drafter(policy, N, drafter_names(checkpoint_weight_names(policy), N), folder)
    built = [_engine(policy),
             _engine(policy, SpeculativeConfig(method="draft_model", draft_layers=N)),
             _engine(policy, SpeculativeConfig(method="draft_model", draft_model_path=str(folder)))]
    yield built
    for e in reversed(built):
        e.close()


def _run(engine):
    """(result, acceptance) of one greedy rollout, from the per-sequence counts vLLM returns (its
    Prometheus counters are one registry per process, the last-built engine's)."""
    before = engine.speculation_counts()
    result = engine.generate(PROMPTS, GREEDY)
    call = engine.speculation_counts() - before
    assert call.drafted > 100, "hardly anything proposed: the test did not exercise speculation"
    return result, call.accepted / call.drafted


def effective_weights(worker, draft: bool):
    """Run in vLLM's worker: the weights the draft model (or the target) computes with, by module.
    On CPU vLLM hands each linear layer's weight to a oneDNN handle and leaves an empty parameter, so
    a linear layer is read by what it does: applied to the identity it returns W^T."""
    from vllm.model_executor.layers.linear import LinearBase

    from verl_hpc.rollout.vllm.worker import draft_model

    model = draft_model(worker) if draft else worker.get_model()
    out = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, LinearBase):
            eye = torch.eye(module.input_size_per_partition, dtype=module.params_dtype)
            out[name] = module.quant_method.apply(module, eye).T.contiguous()
        elif isinstance(weight, torch.nn.Parameter):
            out[name] = weight.detach().to("cpu", copy=True)
    return out


def _drafter_vs_target(engine):
    """The draft model's weights and the target's of the same modules (vLLM's fused names)."""
    draft = engine.llm.collective_rpc(effective_weights, args=(True,))[0]
    target = engine.llm.collective_rpc(effective_weights, args=(False,))[0]
    assert all(t.numel() for t in draft.values()) and any(".qkv_proj" in k for k in draft)
    return draft, {k: target[k] for k in draft}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


class _Policy:
    """A training engine's export: the moved policy's tensors, for a weight sync."""

    def __init__(self, state):
        self.state = state

    def export_hf_weights(self):
        yield from self.state.items()


def _drop_frozen_drafter(engine):
    """What a level-2 sleep does to the frozen drafter on a GPU (its memory freed, its values gone),
    done here by the one loader: noise into every one of its tensors."""
    gen = torch.Generator().manual_seed(5)
    names, tied, _ = vllm_drafter.frozen_drafter(engine)
    noise = [(n, torch.randn(s, generator=gen)) for n, s in MtpWeights.from_draft_model(engine.draft_folder, (0, 1),
                                                                                          None).shapes.items()]
    assert {n for n, _ in noise} == names
    assert not any(engine.llm.collective_rpc(vllm_drafter.load_into_drafter, args=(noise, tied, False)))


def test_the_drafter_folder_is_the_policys_first_layers(engines):
    kept = engines[1]
    assert kept.llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config.num_hidden_layers == N
    draft, target = _drafter_vs_target(kept)
    assert {k.split(".")[2] for k in draft if ".layers." in k} == {str(i) for i in range(N)}
    assert _same(draft, target)


@pytest.mark.heavy
def test_the_synced_drafter_follows_the_policy_and_the_frozen_one_goes_stale(engines, policy, capsys):
    plain, kept, frozen = engines
    reference = plain.generate(PROMPTS, GREEDY)
    (kept_out, kept_before), (frozen_out, frozen_before) = _run(kept), _run(frozen)
    for out in (kept_out, frozen_out):  # lossless before the move
        assert out.response_ids == reference.response_ids and max_diff(out.logprobs, reference.logprobs) <= TOL
    draft_before, _ = _drafter_vs_target(kept)
    frozen_draft_before, _ = _drafter_vs_target(frozen)

    assert _same(frozen_draft_before, _drafter_vs_target(frozen)[1])  # the folder's: the policy's first layers

    moved = moved_state(policy)
    _drop_frozen_drafter(frozen)
    assert not _same(_drafter_vs_target(frozen)[0], frozen_draft_before)
    metrics = [WeightSync(mode="full", bucket_mb=1)(_Policy(moved), engine) for engine in engines]
    assert [m.get("sync/draft_tensors") for m in metrics] == [None, None, len(drafter_names(moved, N))]
    draft, target = _drafter_vs_target(kept)
    assert not _same(target, draft_before), "the policy did not move"
    assert _same(draft, target), "the drafter is not the policy's first layers after the sync"
    frozen_draft, frozen_target = _drafter_vs_target(frozen)
    assert _same(frozen_draft, frozen_draft_before), "the sync did not re-send the frozen drafter's folder"
    assert not _same(frozen_draft, frozen_target)

    reference = plain.generate(PROMPTS, GREEDY)
    (kept_out, kept_after), (frozen_out, frozen_after) = _run(kept), _run(frozen)
    for out in (kept_out, frozen_out):  # lossless after the move, whatever the drafter
        assert out.response_ids == reference.response_ids and max_diff(out.logprobs, reference.logprobs) <= TOL
    with capsys.disabled():
        print(f"\nacceptance (draft_layers = {N}, greedy): kept in step {kept_before:.3f} -> {kept_after:.3f}, "
              f"frozen {frozen_before:.3f} -> {frozen_after:.3f}")
    # sampled: every reported log-prob is the moved policy's own (teacher-forced transformers)
    hf = load_hf(policy, moved)
    sampled = kept.generate(PROMPTS, default_spec(temperature=1.0, max_tokens=16, n=2, seed=3))
    worst = max(max(abs(x - y) for x, y in zip(teacher_forced_logprobs(hf, PROMPTS[i], r), lp))
                for i, r, lp in zip(sampled.prompt_index, sampled.response_ids, sampled.logprobs))
    assert worst <= TOL, worst
    assert kept_before == pytest.approx(frozen_before)  # the same drafter until the move
    assert kept_after >= 0.8 * kept_before, (kept_before, kept_after)
    assert frozen_after <= 0.6 * kept_after, (frozen_after, kept_after)


# ------------------------------------------------------------------ without an engine
def test_the_drafters_share_of_a_sync_must_be_whole(tiny_model):
    """load() refuses a drafter tensor short (a stream that bypassed tap), before any worker call."""
    sync = draft_sync.DraftSync(tiny_model, 1)
    try:
        stream = [(n, torch.zeros(1)) for n in sorted(sync.names)]
        assert list(sync.tap(stream)) == stream and set(sync.kept) == sync.names
        sync.kept.pop("model.norm.weight")

        class NoWorker:
            def collective_rpc(self, *a, **k):
                raise AssertionError("reached the workers with an incomplete drafter")

        with pytest.raises(ValueError, match="lacks 1 of the model's"):
            sync.load(NoWorker())
        folder = sync.folder
        assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    finally:
        sync.close()
    assert not folder.exists()


@pytest.mark.parametrize("kw, wanted", [
    (dict(tp=2), "not with rollout.tp > 1"),
    (dict(lora_rank=8), "not with LoRA slots"),
    (dict(impl="transformers"), "not with vLLM's Transformers modelling backend"),
])
def test_the_engine_refuses_layouts_it_does_not_sync(tiny_model, kw, wanted):
    with pytest.raises(ConfigError, match=f"rollout.speculative.draft_layers = 1: {wanted}"):
        draft_sync.DraftSync(tiny_model, 1, **kw)
    with pytest.raises(ConfigError, match=r"must be in \[1, 1\] \(the policy has 2 decoder layers\)"):
        draft_sync.DraftSync(tiny_model, 2)


@pytest.mark.heavy
def test_a_frozen_draft_models_tp_slices_rebuild_its_folder(policy, tmp_path):
    """rollout.tp = 2: each rank keeps its part of the draft folder's tensors by the decoder layers'
    rules (q/k/v and gate/up rows, o/down columns, the vocabulary by padded rows, norms whole), and
    the ranks' parts rebuild the folder; at tp = 1 every tensor is whole."""
    from safetensors.torch import load_file

    folder = draft_sync.write_drafter(policy, N, drafter_names(checkpoint_weight_names(policy), N), tmp_path)
    full = load_file(str(folder / "model.safetensors"))
    whole = {n: p for n, p, _ in MtpWeights.from_draft_model(folder, (0, 1), None).slices()}
    assert set(whole) == set(full) and all(torch.equal(whole[n], full[n]) for n in full)
    ranks = [{n: (p, need) for n, p, need in MtpWeights.from_draft_model(folder, (r, 2), None).slices()}
             for r in range(2)]
    cut = set()
    for name, tensor in full.items():
        (a, na), (b, nb) = ranks[0][name], ranks[1][name]
        if (na.start, na.stop) == (nb.start, nb.stop):
            assert torch.equal(a, tensor) and torch.equal(b, tensor), name
        else:
            cut.add(name.split(".")[-2])
            assert torch.equal(torch.cat([a, b], dim=na.dim), tensor), name
    assert cut == {"embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"}
