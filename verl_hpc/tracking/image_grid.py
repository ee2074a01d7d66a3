"""A PNG grid of pictures with caption lines under each: what a model saw and what it answered.

    lines = answer_lines("How many dots?", "3", {"before RL": ("4", False), "after RL": ("3", True)})
    write_image_grid("out/val_grid.png", images, [lines, ...], columns=6, title="visual task, validation")

Generic: rows of images (PIL images, or encoded bytes as the data files hold them), each with any
number of caption lines, a line being text or (text, colour). answer_lines builds the usual
caption: the question, the ground truth, and one line per model answer in green when right and red
when wrong. Small pictures are enlarged by a whole factor with nearest-neighbour sampling, so a
56 x 56 picture shows its pixels as the model got them instead of a blur; larger ones are shrunk to
fit. Captions wrap at the cell's width (measured in the font, not guessed from a character count).

Drawn with Pillow onto a canvas of computed size rather than with matplotlib: the layout is in
pixels, the file's size follows from the number of cells and caption lines, and no figure state is
involved. The font is Pillow's bundled one (FreeType where Pillow has it, else its bitmap font).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Tuple, Union

Line = Union[str, Tuple[str, str]]  # text, or (text, colour: a name or "#rrggbb")

GOOD, BAD = "#1a7f37", "#c62828"  # the colour of a right / a wrong answer
TEXT, MUTED, FRAME, BACKGROUND = "#202020", "#606060", "#b0b0b0", "#ffffff"
PAD = 8  # pixels around each cell's content
CAPTION_EXTRA = 40  # a cell is this much wider than its image box: captions get room to breathe
MAX_LINE_CHARS = 200  # a rambling answer is cut here before it is wrapped


@dataclass(frozen=True)
class GridResult:
    path: Path
    size: Tuple[int, int]  # (width, height) in pixels
    columns: int
    rows: int
    cell_width: int


def answer_lines(question: str, ground_truth: str, answers: Mapping[str, Tuple[str, bool]]) -> list:
    """The caption of one sample: the question, the ground truth, and each labelled answer
    ({"before RL": (text, correct), ...}) in green or red."""
    lines: list = [question, (f"truth: {ground_truth}", MUTED)]
    for label, (text, correct) in answers.items():
        lines.append((f"{label}: {text.strip() or '(empty)'}", GOOD if correct else BAD))
    return lines


def _as_image(item: Any):
    from PIL import Image

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, dict):  # a row's {bytes, path} image
        item = item.get("bytes") or item.get("path")
    if isinstance(item, (bytes, bytearray, memoryview)):
        with Image.open(io.BytesIO(bytes(item))) as img:
            return img.convert("RGB")
    if isinstance(item, (str, Path)):
        with Image.open(item) as img:
            return img.convert("RGB")
    return Image.fromarray(item).convert("RGB")  # an (H, W, 3) uint8 array


def _fit(image, box: int):
    """`image` enlarged by a whole factor (nearest) or shrunk to fit a box x box square."""
    from PIL import Image

    w, h = image.size
    if max(w, h) <= box:
        k = box // max(w, h)
        return image.resize((w * k, h * k), Image.NEAREST) if k > 1 else image
    k = box / max(w, h)
    return image.resize((max(1, round(w * k)), max(1, round(h * k))), Image.LANCZOS)


def _wrap(text: str, font, width: int) -> list:
    """`text` in lines no wider than `width` pixels; a word too long for one line is cut."""
    text = " ".join(str(text).split())
    if len(text) > MAX_LINE_CHARS:
        text = text[:MAX_LINE_CHARS - 3] + "..."
    lines, current = [], ""
    for word in text.split(" "):
        trial = f"{current} {word}" if current else word
        if font.getlength(trial) <= width:
            current = trial
            continue
        if current:
            lines.append(current)
        while font.getlength(word) > width:  # cut an over-long word, marking the cut
            cut = next((i for i in range(len(word) - 1, 0, -1) if font.getlength(word[:i] + "-") <= width), 1)
            lines.append(word[:cut] + "-")
            word = word[cut:]
        current = word
    if current or not lines:  # an empty caption line stays a (blank) line
        lines.append(current)
    return lines


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # a Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def write_image_grid(path: Union[str, Path], images: Sequence[Any], captions: Sequence[Sequence[Line]],
                     columns: int = 6, title: str = "", image_px: int = 168, font_size: int = 12) -> GridResult:
    """One PNG at `path`: the images in rows of `columns`, each in an image_px square box with its
    caption lines below; a row is as tall as its longest caption."""
    from PIL import Image, ImageDraw

    if len(images) != len(captions) or not images:
        raise ValueError(f"write_image_grid: {len(images)} images and {len(captions)} captions; "
                         "expected one caption (a list of lines) per image, at least one")
    if columns < 1 or image_px < 8:
        raise ValueError(f"write_image_grid: columns {columns} and image_px {image_px}; expected >= 1 and >= 8")
    font, title_font = _font(font_size), _font(round(font_size * 1.4))
    ascent, descent = font.getmetrics()
    line_h = ascent + descent + 3
    cell_w = image_px + CAPTION_EXTRA + 2 * PAD
    text_w = cell_w - 2 * PAD
    cells = []  # (image, [(text, colour), ...]) with captions wrapped
    for item, caption in zip(images, captions):
        wrapped = []
        for line in caption:
            text, colour = (line, TEXT) if isinstance(line, str) else line
            wrapped += [(piece, colour) for piece in _wrap(text, font, text_w)]
        cells.append((_fit(_as_image(item), image_px), wrapped))
    columns = min(columns, len(cells))
    n_rows = math.ceil(len(cells) / columns)
    row_h = [2 * PAD + image_px + PAD // 2 + line_h * max(len(c[1]) for c in cells[r * columns:(r + 1) * columns])
             for r in range(n_rows)]
    title_h = 0
    if title:
        t_ascent, t_descent = title_font.getmetrics()
        title_h = t_ascent + t_descent + 2 * PAD
    size = (columns * cell_w, title_h + sum(row_h))
    canvas = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((size[0] // 2, PAD), title, fill=TEXT, font=title_font, anchor="ma")
    for i, (image, lines) in enumerate(cells):
        r, c = divmod(i, columns)
        x0, y0 = c * cell_w, title_h + sum(row_h[:r])
        # the picture centred in its box, framed: a white picture on the white page keeps its edges
        ix = x0 + (cell_w - image.width) // 2
        iy = y0 + PAD + (image_px - image.height) // 2
        canvas.paste(image, (ix, iy))
        draw.rectangle((ix - 1, iy - 1, ix + image.width, iy + image.height), outline=FRAME)
        y = y0 + PAD + image_px + PAD // 2
        for text, colour in lines:
            draw.text((x0 + cell_w // 2, y), text, fill=colour, font=font, anchor="ma")
            y += line_h
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, format="PNG")
    return GridResult(path=path, size=size, columns=columns, rows=n_rows, cell_width=cell_w)
