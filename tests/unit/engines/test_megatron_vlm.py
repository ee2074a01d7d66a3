"""The Megatron engine on a vision-language model (a tiny Qwen2.5-VL, verl_hpc/models/tiny_vlm.py: the
language model as Megatron's GPTModel with M-RoPE, transformers' vision tower on the first stage;
models/vlm.py), one gloo rank, in process, against plain transformers:

- M-RoPE positions: the engine's (the prompt's get_rope_index, each response token at its own
  position + the prompt's delta) equal transformers' get_rope_index of the whole sequence, plain and
  packed (prompt sharing);
- the response log-probs of image prompts (one and two images of different sizes, a text-only row)
  equal a float64 transformers forward of each row alone, within the text models' parity bound, in
  one micro-batch and in micro-batches of one; with the pixels zeroed they do not;
- the vision tower is frozen by default (an update leaves it bitwise, the language model moves) and
  trains with vision.train_vision_tower; LoRA adapts the language model only;
- packed prompts (GRPO's groups, two prompts whose tokens are equal but whose pictures differ) give
  the plain rows' log-probs and update;
- the exported weights, written as a folder, load in transformers (every tensor by name), reproduce
  the engine's log-probs and answer an image prompt with generate.
The multi-rank layouts (TP2, PP2, TP2 x PP2 = TP1) are tests/dist/engines/test_eng_vlm_parity.py.
"""
import shutil

import pytest
import torch

from engine_states import one_rank_world
from vlm_reference import hf_logprobs64, image_batch

LOGP_TOL = 2e-5  # the engines' parity bound (fp32 engine vs float64 transformers)
OPTIM = dict(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny Qwen2.5-VL folder, in a one-rank world with Megatron's parallel state."""
    from verl_hpc.models.tiny_vlm import make_tiny_vlm
    from verl_hpc.parallel import cpu_compat, destroy_model_parallel, init_model_parallel

    tmp = tmp_path_factory.mktemp("megatron_vlm")
    folder = make_tiny_vlm(tmp / "qwen2_5_vl", "qwen2_5_vl")
    with one_rank_world(tmp / "world"):
        init_model_parallel(1, 1)
        try:
            yield folder
        finally:
            destroy_model_parallel()
            cpu_compat.revert()


def _engine(folder, **changes):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options

    opts = dict(model_path=str(folder), optim=OptimConfig(**OPTIM), micro_batch_size=4, total_steps=4)
    return MegatronEngine(default_options(**{**opts, **changes}))


def _update(engine, batch):
    """One policy update; (weights before, after) as exported."""
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.megatron import Actor

    before = {n: t.clone() for n, t in engine.export_hf_weights()}
    cfg = ActorConfig(ppo_mini_batch_size=64)
    metrics = Actor(engine, cfg).update(batch, PolicyObjective.from_config(cfg))
    after = {n: t.clone() for n, t in engine.export_hf_weights()}
    return before, after, metrics


def _moved(before, after, prefix):
    return [n for n in before if n.startswith(prefix) and not torch.equal(before[n], after[n])]


def test_mrope_positions_are_transformers_own(vlm):
    from verl_hpc.data.processor import collate_inputs
    from verl_hpc.engines.megatron.vision import model_inputs
    from verl_hpc.engines.prefix import PromptSharing, CostModel
    from verl_hpc.models import load_arch
    from verl_hpc.models.vlm import rope_index

    vision = load_arch(vlm).vision
    batch, _ = image_batch(vlm, repeats=(2, 1, 1, 3))
    n = batch["input_ids"].shape[0]
    lengths = batch["prompt_lengths"] + batch["response_lengths"]
    grid = collate_inputs(batch["image_inputs"])["image_grid_thw"]
    want, _ = rope_index(vision, batch["input_ids"], lengths, grid)  # transformers on whole sequences
    assert not torch.equal(want[1], want[0]), "an image's tokens have their own height positions"
    got, images = model_inputs(vision, batch, None, "cpu")
    real = torch.arange(want.shape[2]).unsqueeze(0) < lengths.unsqueeze(1)
    assert torch.equal(got[:, real], want[:, real])
    assert torch.equal(images["pixel_values"], collate_inputs(batch["image_inputs"])["pixel_values"])
    # packed: every sample's tokens at their packed columns carry its unpacked positions
    width = int(batch["response_lengths"].max())
    packed = PromptSharing(CostModel(0.0), force=True)(batch, width)
    assert packed is not None and packed.input_ids.shape[0] == 4  # one row per prompt
    pos, images = model_inputs(vision, batch, packed, "cpu")
    assert images["image_grid_thw"].shape[0] == 4  # each prompt's images once: 1 + 1 + 0 + 2
    for i in range(n):
        row, p, r = int(packed.sample_rows[i]), int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
        assert torch.equal(pos[:, row, :p], want[:, i, :p]), i  # the prompt
        # the columns whose outputs score response token t hold the token at p + t - 1 of the sample
        assert torch.equal(pos[:, row, packed.positions[i, :r]], want[:, i, p - 1:p - 1 + r]), i


@pytest.mark.heavy
def test_image_prompt_logprobs_equal_float64_transformers(vlm):
    batch, vp = image_batch(vlm)
    want = hf_logprobs64(vlm, batch, vp.image_token_id)
    mask = batch["response_mask"]
    assert vp.image_tokens(batch["input_ids"][0].tolist()) > 0
    engine = _engine(vlm)
    got = engine.forward(batch, outputs=("log_probs",))["log_probs"]
    diff = float(((got.double() - want[:, :got.shape[1]]).abs() * mask).max())
    assert diff < LOGP_TOL, diff
    one = _engine(vlm, micro_batch_size=1).forward(batch, outputs=("log_probs",))["log_probs"]
    assert float(((one - got).abs() * mask).max()) < 1e-5
    # the images are read: zero pixels move the image rows' log-probs, not the text-only row's
    blank = dict(batch, image_inputs=[None if x is None else dict(x, pixel_values=torch.zeros_like(x["pixel_values"]))
                                      for x in batch["image_inputs"]])
    other = engine.forward(blank, outputs=("log_probs",))["log_probs"]
    delta = ((other - got).abs() * mask).amax(dim=1)
    assert float(delta[0]) > 1e-3 and float(delta[3]) > 1e-3 and float(delta[2]) == 0.0, delta


@pytest.mark.heavy
def test_vision_tower_frozen_by_default_and_trainable_by_config(vlm):
    batch, _ = image_batch(vlm, seed=1)
    engine = _engine(vlm)
    assert not any(p.requires_grad for p in engine.gpt_chunks[0].visual.parameters())
    before, after, _ = _update(engine, batch)
    assert _moved(before, after, "model.language_model.") and not _moved(before, after, "model.visual.")
    assert any(n.startswith("model.visual.") for n in before) and "lm_head.weight" in before
    engine = _engine(vlm, train_vision_tower=True)
    before, after, _ = _update(engine, batch)
    assert _moved(before, after, "model.language_model.") and _moved(before, after, "model.visual.")
    assert all(p.average_gradients_across_tp_domain for p in engine.gpt_chunks[0].visual.parameters())


@pytest.mark.heavy
def test_lora_adapts_the_language_model_only(vlm):
    """The tower's MLP has the decoder's leaf names (gate/up/down_proj): the adapters sit on the
    decoder's layers alone, PEFT's config excludes the tower, an update moves the adapters and the
    merged language model, never the tower."""
    from verl_hpc.config.schema import LoraConfig

    batch, _ = image_batch(vlm, seed=2)
    engine = _engine(vlm, lora=LoraConfig(rank=4, alpha=8, target_modules=["linear_qkv", "linear_fc1", "linear_fc2"]))
    adapters = {n: t.clone() for n, t in engine.export_adapter()}
    assert adapters and all(n.startswith("base_model.model.model.language_model.layers.") for n in adapters)
    assert any("gate_proj" in n for n in adapters)
    assert engine.adapter_config()["exclude_modules"] == r".*\.visual\..*"
    before, after, _ = _update(engine, batch)
    assert _moved(before, after, "model.language_model.") and not _moved(before, after, "model.visual.")
    assert any(not torch.equal(adapters[n], t) for n, t in engine.export_adapter())


@pytest.mark.heavy
def test_packed_prompts_with_images_equal_plain_rows(vlm):
    """GRPO's groups packed one row per prompt: the log-probs and the update equal one row per
    sample. The second and third prompts are one question over two pictures of one size: equal
    token ids, which must not share a row."""
    batch, _ = image_batch(vlm, seed=5, sizes=((70, 100), (56, 84), (56, 84), None), repeats=(3, 2, 2, 2),
                           question="Which colour?")
    assert torch.equal(batch["input_ids"][3, :int(batch["prompt_lengths"][3])],
                       batch["input_ids"][5, :int(batch["prompt_lengths"][5])])
    mask = batch["response_mask"]
    plain, packed = _engine(vlm, share_prompts="off"), _engine(vlm, share_prompts="on", micro_batch_size=9)
    a, b = (e.forward(batch, outputs=("log_probs",))["log_probs"] for e in (plain, packed))
    assert float(((a - b).abs() * mask).max()) < 1e-5
    _, w_plain, _ = _update(plain, batch)
    _, w_packed, m = _update(packed, batch)
    assert m["actor/packed_microbatches"] > 0
    assert max(float((w_plain[n] - w_packed[n]).abs().max()) for n in w_plain) < 1e-5


@pytest.mark.heavy
def test_export_loads_in_transformers_and_answers_image_prompts(vlm, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    from verl_hpc.data.processor import image_messages, token_types

    batch, vp = image_batch(vlm, seed=6)
    engine = _engine(vlm)
    _, weights, _ = _update(engine, batch)
    out = tmp_path / "exported"
    out.mkdir()
    for f in vlm.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"))
    hf = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    state = hf.state_dict()
    assert sorted(weights) == sorted(state), sorted(set(weights) ^ set(state))
    assert all(torch.equal(weights[n], state[n]) for n in weights)
    got = engine.forward(batch, outputs=("log_probs",))["log_probs"]
    want = hf_logprobs64(out, batch, vp.image_token_id)
    assert float(((got.double() - want[:, :got.shape[1]]).abs() * batch["response_mask"]).max()) < LOGP_TOL
    from PIL import Image

    messages, _ = image_messages("<image>What colour is it?")
    ids, inp = vp.encode(vp.render(messages), [Image.new("RGB", (84, 56), (200, 30, 30))])
    ids = torch.tensor([ids])
    with torch.no_grad():
        answer = hf.generate(input_ids=ids, **inp, mm_token_type_ids=token_types(ids, vp.image_token_id),
                             max_new_tokens=4, do_sample=False)
    assert answer.shape[1] > ids.shape[1]


def test_layouts_the_engine_does_not_build_are_refused_before_any_weight(vlm):
    from verl_hpc.config.errors import ConfigError
    from verl_hpc.engines.megatron.vision import check_layout
    from verl_hpc.models import load_arch

    arch = load_arch(vlm)
    check_layout(arch, cp=1, vpp=None, head="lm")
    for kw, says in ((dict(cp=2, vpp=None, head="lm"), "parallel.cp = 2: context parallelism is not built"),
                     (dict(cp=1, vpp=2, head="lm"), "parallel.vpp = 2: virtual pipeline stages are not built"),
                     (dict(cp=1, vpp=None, head="value"), "a value or reward head on it is not supported")):
        with pytest.raises(ConfigError, match=says):
            check_layout(arch, **kw)


@pytest.mark.heavy
def test_the_released_checkpoints_layout_loads_alike(vlm, tmp_path):
    """Qwen2.5-VL as released (transformers 4's layout): the language model's fields at the top of
    config.json with rope_scaling {type: mrope}, tensors named model.layers.* and visual.*. The engine
    reads it to the same model as transformers 5's layout, and exports transformers 5's names."""
    import json

    from safetensors.torch import load_file, save_file

    old = tmp_path / "released"
    shutil.copytree(vlm, old)
    cfg = json.loads((vlm / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    cfg.update({k: v for k, v in text.items() if k not in ("model_type", "dtype")})
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    (old / "config.json").write_text(json.dumps(cfg))
    renamed = {n.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
               for n, t in load_file(str(vlm / "model.safetensors")).items()}
    assert any(n.startswith("visual.") for n in renamed) and any(n.startswith("model.layers.") for n in renamed)
    save_file(renamed, str(old / "model.safetensors"))
    batch, _ = image_batch(vlm, seed=8)
    new_engine, old_engine = _engine(vlm, trainable=False), _engine(old, trainable=False)
    a, b = (e.forward(batch, outputs=("log_probs",))["log_probs"] for e in (new_engine, old_engine))
    assert torch.equal(a, b)
    assert sorted(n for n, _ in old_engine.export_hf_weights()) == sorted(n for n, _ in new_engine.export_hf_weights())
