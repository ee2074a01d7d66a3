"""The FSDP engine on a vision-language model (a tiny Qwen2.5-VL, verl_hpc/models/tiny_vlm.py), one
gloo rank, in process, against plain transformers:

- the response log-probs of image prompts (rows with one or two images of different sizes, and a
  text-only row, in one micro-batch) equal a float64 transformers forward of each row alone, with
  the same pixel values, grid and token types, within the engine's parity bound;
- the vision tower is frozen by default (an update leaves it bitwise, the language model moves),
  and trains with vision.train_vision_tower;
- a micro-batch without images runs (the M-RoPE path is taken only where images are).
The multi-rank equality (2 ranks = 1 rank) is tests/dist/engines/test_fsdp_vlm_ranks.py.
"""
import dataclasses

import pytest
import torch

from verl_hpc.config.schema import OptimConfig
from vlm_reference import hf_logprobs64, image_batch

LOGP_TOL = 2e-5  # the engine's parity bound (fp32 engine vs float64 transformers)
OPTIM = OptimConfig(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_5_vl", "qwen2_5_vl")


def _engine(folder, **changes):
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    base = dict(optim=OPTIM, micro_batch_size=4, temperature=1.0, total_steps=4, engine="fsdp")
    return FsdpEngine(default_options(str(folder), **{**base, **changes}))


def test_image_prompt_logprobs_equal_transformers(one_rank_world, vlm):
    batch, vp = image_batch(vlm)
    engine = _engine(vlm)
    got = engine.forward(batch, outputs=("log_probs",))["log_probs"]
    want = hf_logprobs64(vlm, batch, vp.image_token_id)
    mask = batch["response_mask"]
    assert vp.image_tokens(batch["input_ids"][0].tolist()) > 0
    diff = float(((got.double() - want[:, :got.shape[1]]).abs() * mask).max())
    assert diff < LOGP_TOL, diff
    # and with the rows split over micro-batches of one (text-only and image micro-batches apart)
    single = _engine(vlm, micro_batch_size=1).forward(batch, outputs=("log_probs",))["log_probs"]
    assert float(((single - got).abs() * mask).max()) < 1e-5


def _update(engine, batch):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig

    loss = PolicyObjective.from_config(ActorConfig(ppo_mini_batch_size=8))
    before = {n: t.clone() for n, t in engine.export_hf_weights()}
    engine.train_step(batch, loss)
    after = {n: t.clone() for n, t in engine.export_hf_weights()}
    moved = lambda prefix: any(not torch.equal(before[n], after[n]) for n in before if n.startswith(prefix))  # noqa: E731
    return moved("model.visual."), moved("model.language_model.")


def test_vision_tower_frozen_by_default_and_trainable_by_config(one_rank_world, vlm):
    batch, _ = image_batch(vlm, seed=1)
    vision_moved, lm_moved = _update(_engine(vlm), batch)
    assert lm_moved and not vision_moved
    vision_moved, lm_moved = _update(_engine(vlm, train_vision_tower=True), batch)
    assert lm_moved and vision_moved


def test_lora_adapts_the_language_model_only(one_rank_world, vlm):
    """The vision MLP shares leaf names with the decoder's (gate/up/down_proj): the adapters must go
    on the language model alone; an update moves them, and the merged weights of the tower stay."""
    from verl_hpc.config.schema import LoraConfig

    batch, _ = image_batch(vlm, seed=2)
    engine = _engine(vlm, lora=LoraConfig(rank=4, alpha=8, target_modules=["linear_qkv", "linear_fc1", "linear_fc2"]))
    before = {n: t.clone() for n, t in engine.export_adapter()}
    assert before and all(".language_model." in n for n in before), sorted(before)[:4]
    assert any("gate_proj" in n for n in before)
    vision_moved, lm_moved = _update(engine, batch)  # the merged weights the sync sends
    assert lm_moved and not vision_moved
    after = dict(engine.export_adapter())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_an_update_in_mini_batches_keeps_the_images(one_rank_world, vlm):
    """The actor's update cuts the batch into mini-batches: each keeps its rows' images, so the
    update's own forward (before its step) gives the log-probs of a forward of the whole batch (a
    mini-batch that kept only the tensors read the image tokens as text, 0.35-0.95 nats off in
    the demo's GRPO)."""
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.roles import Actor

    batch, _ = image_batch(vlm, seed=3)
    engine = _engine(vlm)
    batch["rollout_log_probs"] = engine.forward(batch, outputs=("log_probs",))["log_probs"]
    cfg = ActorConfig(ppo_mini_batch_size=4)  # one mini-batch of the 4 rows, cut out as any other
    loss = dataclasses.replace(PolicyObjective.from_config(cfg), old_from_update=True, skip_zero_advantage_rows=False)
    m = Actor(engine, cfg).update(batch, loss)
    assert m["actor/rollout_logprob_diff_mean"] < 1e-5, m


def test_image_tokens_without_images_are_refused(one_rank_world, vlm):
    batch, _ = image_batch(vlm, seed=4)
    batch.pop("image_inputs")
    with pytest.raises(ValueError, match=r"hold image tokens \(id \d+\) but the batch carries no image_inputs"):
        _engine(vlm).forward(batch, outputs=("log_probs",))


@pytest.mark.heavy  # two engines, an update, a checkpoint written and read: over make check's 5 s
def test_a_state_written_in_hf_names_still_loads(one_rank_world, vlm, tmp_path):
    """Qwen2.5-VL's states are in Megatron's coordinates now (the Megatron engine holds it too); one
    this engine wrote before, in HF names (`coords: hf`), still resumes: weights and Adam's moments."""
    from engine_states import load, save
    from verl_hpc.engines.fsdp.state import Coords

    batch, _ = image_batch(vlm, seed=7)
    old = _engine(vlm, train_vision_tower=True)
    _update(old, batch)
    assert old.coords.kind == "megatron" and old.coords.vision
    old.coords = Coords("hf")
    meta = save(old, tmp_path / "ckpt", 1, {"fsdp": 1})
    assert meta["coords"] == "hf"
    new = _engine(vlm, train_vision_tower=True)
    load(new, tmp_path / "ckpt" / "step_000001")
    want = {t.name: t.local for t in old.state().tensors}
    new.coords = Coords("hf")
    got = {t.name: t.local for t in new.state().tensors}
    assert sorted(got) == sorted(want) and any(n.startswith("optim/exp_avg/model.visual.") for n in got)
    assert all(torch.equal(got[n], want[n]) for n in want)
