"""A row's images: read, decoded with Pillow and checked against the `vision:` limits.

An image in a row is bytes (a parquet binary column), a path (relative paths resolve against the
data file's folder, as a data set shipped with its images expects), or the {bytes, path} dict that
Hugging Face datasets' Image feature writes to parquet. Each check is a DataError naming the image's
index in the row; the caller prefixes the row. Decoding here is the real decode (`Image.load()`), not the
header only: a truncated file passes a header check and fails in the middle of a rollout.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from verl_hpc.config.sections.vision import VisionConfig
from verl_hpc.data.errors import DataError


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int
    max_bytes: int
    max_images: int

    @classmethod
    def from_config(cls, vision=None, **changes) -> "ImageLimits":
        """The limits of the vision section (None: its defaults), with `changes` replaced."""
        vision = vision or VisionConfig()
        limits = dict(max_pixels=vision.max_image_pixels, max_bytes=vision.max_image_bytes,
                      max_images=vision.max_images_per_prompt)
        return cls(**{**limits, **changes})


def image_bytes(item: Any, base_dir: str = "", max_bytes: Optional[int] = None) -> Tuple[bytes, str]:
    """(encoded bytes, what to call the image in a message) of one item of a row's images. A file
    over `max_bytes` is refused by its size, before it is read (a 2 GiB file listed as an image
    would otherwise be read whole first)."""
    if isinstance(item, dict):  # HF datasets' Image feature in parquet: {"bytes": ..., "path": ...}
        if item.get("bytes"):
            return bytes(item["bytes"]), "bytes"
        item = item.get("path")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item), "bytes"
    if isinstance(item, str) and item:
        path = item if os.path.isabs(item) else os.path.join(base_dir, item)
        if not os.path.isfile(path):
            raise DataError(f"'{item}': no such file" + (f" (looked in {base_dir})" if base_dir else ""))
        size = os.path.getsize(path)
        if max_bytes is not None and size > max_bytes:
            raise DataError(f"'{item}' is {size:,} bytes, over vision.max_image_bytes = {max_bytes:,}")
        with open(path, "rb") as f:
            return f.read(), f"'{item}'"
    raise DataError(f"is {type(item).__name__}; expected image bytes, a path, or a {{bytes, path}} dict")


def decode_image(data: bytes, limits: ImageLimits, name: str = "the image"):
    """The RGB PIL image of `data`, or an DataError naming what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise DataError(f"{name} is {len(data):,} bytes, over vision.max_image_bytes = {limits.max_bytes:,}")
    try:
        with Image.open(io.BytesIO(data)) as probe:  # the header only: size before any pixel is decoded
            width, height = probe.size
    except UnidentifiedImageError:
        raise DataError(f"{name} does not decode as an image (not a format Pillow reads)") from None
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError... on a damaged header
        raise DataError(f"{name} does not decode as an image ({type(e).__name__}: {e})") from None
    if width * height > limits.max_pixels:
        raise DataError(f"{name} is {width} x {height} = {width * height / 1e6:.1f} megapixels, over "
                           f"vision.max_image_pixels = {limits.max_pixels / 1e6:.1f} megapixels")
    try:
        # Pillow's own decompression-bomb guard is off here: the limit above is the configured one
        Image.MAX_IMAGE_PIXELS = None
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return to_rgb(img)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{name} does not decode as an image ({type(e).__name__}: {e})") from None


def to_rgb(img):
    """8-bit RGB, the model processors' input. Pillow's own `convert("RGB")` clips the integer
    modes of 16-bit greyscale (PNG, TIFF: "I;16", "I") at 255, so a 16-bit picture would arrive all
    white: those are scaled to 8 bits (v / 257: 65535 -> 255, rounded), and a float image ("F") is
    taken as 0..1 and clipped. Every other mode is Pillow's conversion."""
    from PIL import Image

    if not (img.mode.startswith("I") or img.mode == "F"):
        return img.convert("RGB")
    import numpy as np

    values = np.asarray(img, dtype=np.float64)
    scaled = values * 255.0 if img.mode == "F" else values / 257.0
    grey = np.clip(np.rint(scaled), 0, 255).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")  # uint8 2-D: mode L


def load_images(items: Optional[Sequence[Any]], limits: ImageLimits, base_dir: str = "") -> List[Any]:
    """Every image of one row, decoded; an DataError names the first bad one by its index."""
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        raise DataError(f"is {type(items).__name__}; expected a list of images")
    if len(items) > limits.max_images:
        raise DataError(f"holds {len(items)} images, over vision.max_images_per_prompt = {limits.max_images}")
    out = []
    for i, item in enumerate(items):
        try:
            data, name = image_bytes(item, base_dir, limits.max_bytes)
            out.append(decode_image(data, limits, name))
        except DataError as e:
            raise DataError(f"image {i}: {e}") from None
    return out


def png_bytes(image) -> bytes:
    """A PIL image as PNG bytes: how images travel in data files the project writes."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
