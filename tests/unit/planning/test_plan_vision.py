"""The memory plan's vision side (verl_hpc/planning/vision.py): the tower's parameter count against
the model transformers builds from the same config (Qwen2.5-VL and Qwen3-VL: different norms, MLPs,
position table and deepstack mergers), and what the FSDP role adds for it: the tower's fp32 weight
shards (plus gradients and Adam's moments when it trains), its gathered copy, and per micro-batch the
largest images' pixel values and tower activations."""
import dataclasses

import pytest

from verl_hpc.config.schema import JobConfig
from verl_hpc.planning import fsdp as fsdp_plan
from verl_hpc.planning.model_shape import fsdp_arch
from verl_hpc.planning.vision import vision_shape


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    root = tmp_path_factory.mktemp("plan_vlm")
    return {f: make_tiny_vlm(root / f, f) for f in ("qwen2_5_vl", "qwen3_vl")}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tower_parameters_equal_transformers(folders, family):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(folders[family]))
    want = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    v = vision_shape(str(folders[family]))
    assert v.params == want
    # the tiny processor keeps at most 8 x 8 patches of 14 (16) pixels: 64 patches, 16 image tokens
    assert (v.patches_per_image, v.tokens_per_image) == (64, 16)


def test_a_text_model_has_no_vision_side(tmp_path):
    from verl_hpc.models.tiny import make_tiny_model

    assert vision_shape(str(make_tiny_model(tmp_path / "llama"))) is None


@pytest.mark.parametrize("trains", [False, True])
def test_the_fsdp_role_adds_the_tower(folders, trains):
    path = str(folders["qwen2_5_vl"])
    cfg = JobConfig()
    cfg.vision = dataclasses.replace(cfg.vision, train_vision_tower=trains, max_images_per_prompt=2)
    arch, v = fsdp_arch(path), vision_shape(path)
    text = fsdp_plan.fsdp_role(cfg, arch, "lm", trainable=True)
    both = fsdp_plan.fsdp_role(cfg, arch, "lm", trainable=True, vision=v)
    shard = fsdp_plan.shard_size(cfg)
    extra = {k: both.parts[k] - text.parts[k] for k in text.parts}
    n = v.params
    assert extra == pytest.approx({"weights": 4 * n / shard, "grads": 4 * n / shard if trains else 0.0,
                                   "optimizer": 8 * n / shard if trains else 0.0})
    s, b, c = 64, 3, both.c
    for train in (False, True):
        a, w = text.working(s, b, train), both.working(s, b, train)
        assert w["activations"] - a["activations"] == pytest.approx(b * 2 * v.image_bytes(c, train and trains))
        assert w["gathered"] - a["gathered"] == pytest.approx(n * c * (2 if train and trains else 1))
    # more saved when the tower trains (every block's activations) than frozen (one block's)
    assert v.image_bytes(4, True) > v.image_bytes(4, False) > 4 * v.patches_per_image * v.values_per_patch


@pytest.mark.parametrize("trains", [False, True])
def test_the_megatron_role_adds_the_tower_on_the_first_stage(folders, trains):
    """The Megatron engine's Qwen2.5-VL (models/vlm.py): the tower whole on every first-stage rank in the
    model dtype (replicated over TP), trained: fp32 gradients whole and Adam's moments (+ masters) over
    DP; the first stage's micro-batches carry the images; the last stage has none of it."""
    from verl_hpc.models.config_mapping import load_arch
    from verl_hpc.planning.phases import microbatch_shape
    from verl_hpc.planning.roles import plan_roles
    from verl_hpc.planning.training import ActivationSetup, Precision

    path = str(folders["qwen2_5_vl"])
    cfg = JobConfig()
    cfg.model.path, cfg.parallel.engine, cfg.parallel.tp = path, "megatron", 2
    cfg.vision = dataclasses.replace(cfg.vision, train_vision_tower=trains, max_images_per_prompt=2)
    arch, v, prec = load_arch(path), vision_shape(path), Precision.of("bfloat16")
    setup = ActivationSetup(tp=2, sequence_parallel=False, recompute="none", recompute_method="uniform",
                            recompute_num_layers=1, impl="te")

    def plan(stage, vision=True):
        c = cfg if vision else dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, max_images_per_prompt=0))
        return plan_roles(c, arch, stage, prec, setup, True, True, microbatch_shape)

    first, last = plan(0), plan(1)
    assert "actor" in first.vision and not last.vision
    text = plan_roles(cfg, dataclasses.replace(arch, vision=None), 0, prec, setup, True, True, microbatch_shape)
    extra = {k: first.states["actor"].parts[k] - text.states["actor"].parts[k] for k in text.states["actor"].parts}
    n, dp = v.params, max(1, cfg.dp)
    assert extra == pytest.approx({"weights": 2 * n, "grads": 4 * n if trains else 0.0,
                                   "optimizer": 12 * n / dp if trains else 0.0})
    s, b, _ = microbatch_shape(cfg.actor, cfg)
    for train in (False, True):
        got = first.working("actor", cfg.actor, "lm", train)["activations"]
        without = plan(0, vision=False).working("actor", cfg.actor, "lm", train)["activations"]
        assert got - without == pytest.approx(2 * b * v.image_bytes(2, train and trains))
