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
