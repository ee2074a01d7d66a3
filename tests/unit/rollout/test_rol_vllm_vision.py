"""The vLLM image rollout (docs/vlm.md, "Rollout and weight sync") against the trainer, for the two
families vLLM serves and the FSDP engine trains: a tiny Qwen2.5-VL and a tiny Qwen3-VL
(verl_hpc/models/tiny_vlm.py), each served by vLLM's own class with the images as multi_modal_data.

- the per-token mismatch (trainer/stages/batching.logprob_diff_metrics) of vLLM's sampled tokens'
  log-probs against the FSDP engine's forward on the same tokens and images is within the text
  models' bound (rol_helpers.TOL, 1e-4: measured 5e-7), over rows with one image, two images of
  other sizes, and none;
- the weight sync, full, sliced and sliced with delta, each after an update that trains the vision
  tower (vision.train_vision_tower) as well as the language model, with the served-weights check
  after every sync: every tensor vLLM serves, the tower's included, equals what was sent, and the
  rollout's log-probs equal the trained engine's after each;
- vLLM's encoder cache after a reload: an image the engine has encoded, asked again after only the
  tower changed, is encoded with the new weights (transformers' answer on them), not served from
  the cache of the old ones, and is no "Encoder cache miss";
- a tensor served other than it was sent (a vision tower's) is named by the check;
- speculation with images, n-gram (Qwen2.5-VL) and a text draft model (Qwen3-VL): the same greedy
  tokens and log-probs as without.

Runs in the vLLM-range venv only (the marker `torchvision`: vLLM's Qwen-VL classes import it, and
the main venv has no torchvision that imports beside its CPU torch; make test-vllm-range).
"""
import io

import pytest
import torch
from rol_helpers import TOL

from verl_hpc.config.schema import ActorConfig, OptimConfig
from verl_hpc.rollout.engine_config import default_engine_args
from verl_hpc.rollout.sampling import default_spec

pytestmark = [pytest.mark.torchvision, pytest.mark.heavy]
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# (h, w) of each prompt's pictures: one image, two of other sizes, none, one more
SIZES = ((70, 100), (84, 60, 60, 84), None, (56, 56))
OPTIM = OptimConfig(lr=0.05, eps=1e-6, clip_grad=0.0, weight_decay=0.0)
SAMPLED = default_spec(n=2, temperature=1.0, max_tokens=8, seed=3)
GREEDY = default_spec(temperature=0, max_tokens=8)


def _png(h, w, g):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _prompts(folder, seed=0):
    """(token ids, PromptImages or None) per prompt, through the job's own data path."""
    from verl_hpc.data.processor import ImagePrompts, VisionProcessor

    prompts = ImagePrompts(VisionProcessor.load(str(folder)))
    g = torch.Generator().manual_seed(seed)
    ids, media = [], []
    for i, size in enumerate(SIZES):
        images = [] if size is None else [_png(*size[k:k + 2], g) for k in range(0, len(size), 2)]
        _, tokens, m = prompts.encode("<image>" * len(images) + f"What is shown {i}?", images)
        ids.append(tokens)
        media.append(m)
    return ids, media


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world for the FSDP engine, which the vLLM engine then takes as its own (an
    earlier module's in-process engine may have left one on this worker: taken as it is)."""
    import tempfile

    import torch.distributed as dist

    from verl_hpc.parallel import cpu_compat, destroy_model_parallel

    ours = not dist.is_initialized()
    if ours:
        store = tempfile.mkdtemp()
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    yield
    destroy_model_parallel()
    cpu_compat.revert()
    if ours:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_served(request, world, tmp_path_factory):
    """The family's folder, its vLLM engine, the FSDP engine training it (tower included), the prompts."""
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options
    from verl_hpc.models.tiny_vlm import make_tiny_vlm
    from verl_hpc.rollout import VLLMRollout

    folder = make_tiny_vlm(tmp_path_factory.mktemp("vlm") / request.param, request.param)
    rollout = VLLMRollout(str(folder), **default_engine_args("vllm", max_prompt_length=96, max_response_length=8))
    actor = FsdpEngine(default_options(str(folder), optim=OPTIM, micro_batch_size=8, temperature=1.0,
                                       total_steps=8, engine="fsdp", train_vision_tower=True))
    ids, media = _prompts(folder)
    yield dict(family=request.param, folder=folder, rollout=rollout, actor=actor, ids=ids, media=media)
    rollout.close()


def _batch(result, ids, media, seed=0):
    """The trainer's batch of a rollout's rows: tokens, each row's image tensors, the rollout's log-probs."""
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    rows = range(len(result.response_ids))
    batch = pack_sequences([ids[result.prompt_index[r]] for r in rows], result.response_ids)
    mask = get_response_mask(batch)
    lp = torch.zeros(mask.shape)
    for r in rows:
        lp[r, :len(result.logprobs[r])] = torch.tensor(result.logprobs[r])
    g = torch.Generator().manual_seed(seed)
    m = [media[result.prompt_index[r]] for r in rows]
    batch.update(response_mask=mask, image_inputs=[x.inputs if x is not None else None for x in m],
                 rollout_log_probs=lp, old_log_probs=lp, ref_log_probs=lp,
                 advantages=torch.randn(mask.shape, generator=g) * mask)
    return batch


def _mismatch(vlm_served, spec=SAMPLED):
    """The trainer's mismatch metric of a rollout of the prompts against the FSDP engine's forward."""
    from verl_hpc.trainer.stages.batching import logprob_diff_metrics

    result = vlm_served["rollout"].generate(vlm_served["ids"], spec, media=vlm_served["media"])
    batch = _batch(result, vlm_served["ids"], vlm_served["media"])
    got = vlm_served["actor"].forward(batch, outputs=("log_probs",))["log_probs"]
    return logprob_diff_metrics(batch["rollout_log_probs"], got, batch["response_mask"]), batch


def test_the_rollouts_log_probs_of_image_prompts_are_the_trainers(vlm_served):
    metrics, batch = _mismatch(vlm_served)
    assert batch["response_mask"].sum() > 0 and sum(x is not None for x in batch["image_inputs"]) == 6
    print(f"{vlm_served['family']}: vLLM vs FSDP on the sampled tokens: {metrics}")
    assert metrics["rollout/logprob_diff_max"] < TOL, metrics


def test_full_sliced_and_delta_syncs_of_a_trained_tower_are_served(vlm_served):
    """Each sync after an update of the language model and the vision tower; served check after every one."""
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.resharding import WeightSync

    loss = PolicyObjective.from_config(ActorConfig(ppo_mini_batch_size=8))
    syncs = {"full": WeightSync(bucket_mb=1, mode="full", check_served_every=1),
             "sliced": WeightSync(bucket_mb=1, mode="sliced", check_served_every=1),
             "delta": WeightSync(bucket_mb=1, mode="sliced", delta=True, check_served_every=1)}
    names = [n for n, _ in vlm_served["actor"].export_hf_weights()]
    tower = [n for n in names if ".visual." in n]
    for step, (label, sync) in enumerate([*syncs.items(), ("delta", syncs["delta"])]):
        _, batch = _mismatch(vlm_served, SAMPLED.for_step(step))
        before = {n: t.clone() for n, t in vlm_served["actor"].export_hf_weights() if n in tower[:1]}
        vlm_served["actor"].train_step(batch, loss)
        moved = dict(vlm_served["actor"].export_hf_weights())
        assert not torch.equal(before[tower[0]], moved[tower[0]]), "the tower trains"
        m = sync(vlm_served["actor"], vlm_served["rollout"])
        assert (m["sync/served_checked"], m["sync/served_unplaced"]) == (len(names), 0), (label, m)
        metrics, _ = _mismatch(vlm_served, SAMPLED.for_step(10 + step))
        print(f"{vlm_served['family']} after the {label} sync: {metrics}")
        assert metrics["rollout/logprob_diff_max"] < TOL, (label, metrics)


def _reference(folder, state, ids, media, result):
    """transformers' log-probs of `result`'s tokens under `state`, each prompt alone with its images."""
    from transformers import AutoModelForImageTextToText

    from verl_hpc.data.processor import VisionProcessor, token_types

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.load_state_dict(state)
    image_token = VisionProcessor.load(str(folder)).image_token_id
    out = []
    with torch.no_grad():
        for k, response in enumerate(result.response_ids):
            seq = torch.tensor([ids[k] + response])
            extra = dict(media[k].inputs) if media[k] is not None else {}
            logits = model(input_ids=seq, mm_token_type_ids=token_types(seq, image_token), **extra).logits[0]
            logp = torch.log_softmax(logits[len(ids[k]) - 1:-1], -1)
            out.append(logp.gather(1, torch.tensor(response)[:, None])[:, 0].tolist())
    return out


def _max_diff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def test_a_repeated_image_after_a_reload_is_encoded_with_the_new_weights(vlm_served):
    rollout, ids, media = vlm_served["rollout"], vlm_served["ids"], vlm_served["media"]
    state = dict(vlm_served["actor"].export_hf_weights())
    rollout.load_weights(iter(state.items()))
    first = rollout.generate(ids, GREEDY, media=media)  # the images' features now in vLLM's encoder cache
    g = torch.Generator().manual_seed(5)
    tower = {n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in state.items() if ".visual." in n}
    rollout.load_weights(iter({**state, **tower}.items()))
    again = rollout.generate(ids, GREEDY, media=media)
    want = _reference(vlm_served["folder"], {**state, **tower}, ids, media, again)
    assert _max_diff(again.logprobs, want) < TOL
    # the text-only prompt is the same; the image prompts are not (the cache of the old tower would give `first`)
    assert again.response_ids[2] == first.response_ids[2]
    changed = [k for k in (0, 1, 3) if again.response_ids[k] != first.response_ids[k]
               or _max_diff([again.logprobs[k]], [first.logprobs[k]]) > 1e-3]
    assert changed == [0, 1, 3], changed
    rollout.load_weights(iter(state.items()))


def test_a_vision_tensor_served_other_than_sent_is_named(vlm_served):
    from verl_hpc.resharding.served_check import ServedCheck, ServedWeightsError

    state = dict(vlm_served["actor"].export_hf_weights())
    name = "model.visual.blocks.1.attn.proj.weight"
    assert name in state
    check = ServedCheck(every=0)

    def changed(items):  # what reaches the engine differs from what the check recorded
        for n, t in items:
            yield n, (t * 1.5 if n == name else t)

    vlm_served["rollout"].load_weights(changed(check.expect_full(iter(state.items()), None)))
    with pytest.raises(ServedWeightsError, match=rf"serves other values for {name} "):
        check.verify(vlm_served["rollout"])
    vlm_served["rollout"].load_weights(iter(state.items()))


def test_speculation_with_images_is_lossless(vlm_served, tmp_path):
    """vLLM 0.25 drafts a Qwen-VL policy on CPU: by prompt lookup over the token ids (n-gram, the image
    placeholders among them; Qwen2.5-VL) and with a text draft model of the same vocabulary (a 1-layer
    Llama; Qwen3-VL): the greedy tokens and log-probs are those of the plain engine."""
    from verl_hpc.config.sections.speculative import SpeculativeConfig
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout import VLLMRollout

    if vlm_served["family"] == "qwen2_5_vl":
        method = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    else:
        drafter = make_tiny_model(tmp_path / "drafter", "llama", layers=1, vocab_size=500)
        method = SpeculativeConfig(method="draft_model", draft_model_path=str(drafter), num_speculative_tokens=2)
    state = dict(vlm_served["actor"].export_hf_weights())
    vlm_served["rollout"].load_weights(iter(state.items()))
    plain = vlm_served["rollout"].generate(vlm_served["ids"], GREEDY, media=vlm_served["media"])
    spec = VLLMRollout(str(vlm_served["folder"]), speculative=method,
                       **default_engine_args("vllm", max_prompt_length=96, max_response_length=8))
    try:
        spec.load_weights(iter(state.items()))
        drafted = spec.generate(vlm_served["ids"], GREEDY, media=vlm_served["media"])
        assert drafted.response_ids == plain.response_ids
        assert _max_diff(drafted.logprobs, plain.logprobs) < TOL
        assert spec.speculation_counts() is not None
    finally:
        spec.close()
