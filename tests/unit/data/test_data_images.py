"""Image rows (vision-language models): what the data layer accepts and refuses before the queue.

Every refusal is one DataError line naming the sample (file:row) and what is wrong: an image that
does not decode, placeholders and images that do not pair up, an image over the pixel or byte
limit, images given to a text-only model. Accepted rows get their image tokens expanded by the
model's processor path and their images back per batch (PromptBatch.media).
"""
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from verl_hpc.data.errors import DataError
from verl_hpc.data.images import ImageLimits, png_bytes


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("vlm_data") / "qwen2_5_vl", "qwen2_5_vl")


def _picture(w=56, h=56, colour=(200, 30, 30)) -> bytes:
    return png_bytes(Image.new("RGB", (w, h), colour))


def _row(prompt="<image>How many dots?", images=None, **kw):
    return {"prompt": prompt, "images": [_picture()] if images is None else images,
            "data_source": "visual_count", "ground_truth": "2", **kw}


def _load(tmp_path, rows, folder, limits=None):
    from verl_hpc.data.dataset import PromptDataset
    from verl_hpc.data.processor import ImagePrompts, VisionProcessor
    from verl_hpc.models.tiny import train_tokenizer

    files = rows if rows and isinstance(rows[0], list) else [rows]  # one parquet file per list of rows
    paths = []
    for k, part in enumerate(files):
        paths.append(str(tmp_path / ("train.parquet" if k == 0 else f"train{k}.parquet")))
        pq.write_table(pa.Table.from_pylist(part), paths[-1])
    processor = VisionProcessor.load(str(folder)) if folder is not None else None
    tok = processor.tokenizer if processor is not None else train_tokenizer()
    return PromptDataset.load(paths, tok, "prompt", 128, "error", True,
                              images=ImagePrompts(processor, "images", limits or ImageLimits.from_config()))


def test_image_rows_load_with_expanded_image_tokens_and_their_images(tmp_path, vlm):
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    rows = [[_row(), _row(prompt="<image> and <image>: which is red?", images=[_picture(), _picture(84, 56)])],
            [{"prompt": parts, "images": [_picture(112, 112)], "data_source": "visual_colour", "ground_truth": "red"}]]
    ds = _load(tmp_path, rows, vlm)
    vp = ds.vision.processor
    # 56x56 -> 2x2 merged patches (4 tokens); + 84x56 -> 6; 112x112 -> 16
    assert [vp.image_tokens(ids) for ids in ds.token_ids] == [4, 10, 16]
    batch = ds.batch([0, 1, 2])
    assert [len(m) for m in batch.media] == [1, 2, 1]
    assert batch.media[1].inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    # the model itself accepts the expansion (it raises when image tokens and features differ)
    import torch
    from transformers import AutoModelForImageTextToText

    from verl_hpc.data.processor import token_types

    model = AutoModelForImageTextToText.from_pretrained(str(vlm))
    ids = torch.tensor([batch.prompt_ids[1]])
    with torch.no_grad():
        model(input_ids=ids, mm_token_type_ids=token_types(ids, vp.image_token_id), **batch.media[1].inputs)


@pytest.mark.parametrize("row, message", [
    (_row(images=[b"\x89PNG\r\n\x1a\n not really a png"]), "image 0: bytes does not decode as an image"),
    (_row(prompt="<image> and <image>?"), "the prompt has 2 image placeholder(s)"),
    (_row(prompt="No placeholder here"), "the prompt has 0 image placeholder(s)"),
])
def test_bad_image_rows_are_one_line_naming_the_sample(tmp_path, vlm, row, message):
    with pytest.raises(DataError) as e:
        _load(tmp_path, [_row(), row], vlm)
    text = str(e.value)
    assert "\n" not in text and text.startswith("sample train.parquet:1:") and message in text, text


def test_a_100_megapixel_image_is_refused_from_its_header(tmp_path, vlm):
    buf = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buf, format="PNG")  # 100 MP; a 1-bit PNG of a few kB
    with pytest.raises(DataError, match=r"10000 x 10000 = 100\.0 megapixels, over vision\.max_image_pixels"):
        _load(tmp_path, [_row(images=[buf.getvalue()])], vlm)


def test_the_byte_limit_and_the_images_per_prompt_limit(tmp_path, vlm):
    with pytest.raises(DataError, match="over vision.max_image_bytes = 100"):
        _load(tmp_path, [_row()], vlm, ImageLimits.from_config(max_bytes=100))
    with pytest.raises(DataError, match="holds 2 images, over vision.max_images_per_prompt = 1"):
        _load(tmp_path, [_row(prompt="<image><image>", images=[_picture(), _picture()])], vlm,
              ImageLimits.from_config(max_images=1))


def test_images_given_to_a_text_only_model_are_refused(tmp_path):
    with pytest.raises(DataError, match="field 'images' holds 1 image.* but the model is text-only"):
        _load(tmp_path, [_row()], None)


def test_a_vision_language_model_asked_of_the_megatron_engine(vlm):
    """Qwen2.5-VL maps into Megatron (models/vlm.py); what the engine does not build for it, and any
    other vision-language model, is one line naming the field and the way out."""
    from verl_hpc.config.errors import ConfigError
    from verl_hpc.config.hf_model import read_hf_config
    from verl_hpc.config.schema import JobConfig
    from verl_hpc.config.sections.vision import vision_problems
    from verl_hpc.models.config_mapping import _family

    cfg = read_hf_config(str(vlm))
    assert vision_problems(JobConfig(), cfg, "megatron", "model.path") == []
    assert _family(cfg, "model.path") == ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")
    job = JobConfig()
    job.parallel.cp, job.parallel.vpp = 2, 2
    job.lora.rank, job.lora.init_from = 8, "/some/adapter"
    cp, vpp, init_from = vision_problems(job, cfg, "megatron", "model.path")
    assert "parallel.cp = 2: context parallelism is not built for it" in cp and "set parallel.cp=1" in cp
    assert "parallel.vpp = 2: virtual pipeline stages are not built" in vpp
    assert "lora.init_from = '/some/adapter'" in init_from
    other = dict(cfg, architectures=["Qwen3VLForConditionalGeneration"])
    [problem] = vision_problems(JobConfig(), other, "megatron", "model.path")
    assert "vision-language model (Qwen3VLForConditionalGeneration)" in problem
    assert "maps Qwen2_5_VLForConditionalGeneration only; set parallel.engine=fsdp" in problem
    with pytest.raises(ConfigError, match="Qwen3VLForConditionalGeneration is a vision-language model the Megatron "
                                          "engine does not map .*set parallel.engine=fsdp"):
        _family(other, "model.path")
    assert vision_problems(JobConfig(), cfg, "fsdp", "model.path") == []
