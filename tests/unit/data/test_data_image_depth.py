"""Images of more than 8 bits per sample reach the model with their content (data/images.py,
to_rgb): Pillow's convert("RGB") clips a 16-bit greyscale PNG ("I;16") at 255, so on 85ec11b such a
picture arrived pure white. Expected values by hand: an 8-bit sample is round(v / 257) of a 16-bit
one (65535 -> 255, 32896 -> 128), and a float sample round(255 v) of one in 0..1."""
import io

import numpy as np
from PIL import Image

from verl_hpc.data.images import ImageLimits, decode_image, load_images


def _encoded(image, fmt) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_a_16_bit_greyscale_png_is_scaled_to_8_bits():
    values = np.array([[0, 257, 32896, 65535], [1000, 20000, 40000, 60000]], dtype=np.uint16)
    data = _encoded(Image.fromarray(values), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"  # what Pillow reads back
    rgb = np.asarray(decode_image(data, ImageLimits.from_config()))
    want = np.array([[0, 1, 128, 255], [4, 78, 156, 233]], dtype=np.uint8)  # round(v / 257)
    assert rgb.shape == (2, 4, 3)
    assert (rgb == want[..., None]).all(), rgb[..., 0]


def test_a_gradient_keeps_its_content_through_a_row():
    ramp = (np.arange(64, dtype=np.uint32) * 1040).astype(np.uint16).reshape(1, 64).repeat(8, axis=0)
    [img] = load_images([_encoded(Image.fromarray(ramp), "PNG")], ImageLimits.from_config())
    grey = np.asarray(img)[0, :, 0].astype(int)
    assert grey.min() == 0 and grey.max() == round(63 * 1040 / 257) == 255
    assert (np.diff(grey) >= 0).all() and len(set(grey.tolist())) > 50  # a ramp, not one colour


def test_a_float_image_is_taken_as_0_to_1():
    values = np.array([[0.0, 0.5, 1.0, 2.0]], dtype=np.float32)
    rgb = np.asarray(decode_image(_encoded(Image.fromarray(values, mode="F"), "TIFF"), ImageLimits.from_config()))
    assert rgb[..., 0].tolist() == [[0, 128, 255, 255]]


def test_8_bit_modes_are_pillows_conversion():
    pal = Image.new("P", (3, 2))
    pal.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
    pal.putpixel((1, 0), 1)
    for img in (Image.new("RGB", (3, 2), (10, 20, 30)), Image.new("L", (3, 2), 77), pal):
        got = decode_image(_encoded(img, "PNG"), ImageLimits.from_config())
        assert got.mode == "RGB" and np.array_equal(np.asarray(got), np.asarray(img.convert("RGB")))
