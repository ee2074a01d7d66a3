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

LOGP_TOL = 2e-5  # the engine's parity bound (fp32 engine vs float64 transformers)
OPTIM = OptimConfig(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_5_vl", "qwen2_5_vl")


def image_batch(folder, seed=0, sizes=((70, 100), (56, 56), None, (84, 60, 60, 84)), response=6):
    """Rows of the engines' batch format from image prompts: `sizes` per row (h, w) of one image,
    (h, w, h2, w2) of two, None for a text-only prompt; random responses."""
    from PIL import Image

    from verl_hpc.data.processor import VisionProcessor, image_messages
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    vp = VisionProcessor.load(str(folder))
    g = torch.Generator().manual_seed(seed)
    prompts, inputs = [], []
    for i, size in enumerate(sizes):
        dims = [] if size is None else [size[k:k + 2] for k in range(0, len(size), 2)]
        images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
                  for h, w in dims]
        messages, _ = image_messages("".join("<image>" for _ in images) + f"What is shown {i}?")
        ids, inp = vp.encode(vp.render(messages), images)
        prompts.append(ids)
        inputs.append(inp or None)
    responses = [torch.randint(5, 480, (response - i % 3,), generator=g).tolist() for i in range(len(sizes))]
    batch = pack_sequences(prompts, responses)
    mask = get_response_mask(batch)
    batch.update(response_mask=mask, image_inputs=inputs,
                 advantages=torch.randn(mask.shape, generator=g) * mask,
                 old_log_probs=(-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask)
    return batch, vp


def hf_logprobs64(folder, batch, image_token_id):
    """float64 transformers, each row alone with its own images."""
    from transformers import AutoModelForImageTextToText

    from update_reference import response_outputs
    from verl_hpc.data.processor import token_types

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float64).eval()
    rows = []
    with torch.no_grad():
        for b in range(batch["input_ids"].shape[0]):
            n = int(batch["prompt_lengths"][b] + batch["response_lengths"][b])
            ids = batch["input_ids"][b:b + 1, :n]
            inp = batch["image_inputs"][b] or {}
            extra = {k: v.double() if v.is_floating_point() else v for k, v in inp.items()}
            if inp:
                extra["mm_token_type_ids"] = token_types(ids, image_token_id)
            logits = model(input_ids=ids, **extra).logits
            one = {k: v[b:b + 1] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            one["input_ids"] = ids
            logp, _, _ = response_outputs(logits, one)
            rows.append(logp[0])
    width = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


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
