"""The image grid: cells laid out in rows, pictures enlarged pixel for pixel, captions wrapped and
coloured, the file's size following from cells and caption lines."""
import numpy as np
import pytest
from PIL import Image

from verl_hpc.data.images import png_bytes
from verl_hpc.tracking import answer_lines, write_image_grid
from verl_hpc.tracking.image_grid import BAD, GOOD, _font, _wrap

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def solid(rgb, size=(56, 56)):
    return Image.new("RGB", size, rgb)


def near(a, hex_colour, tol=40):
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(a - rgb).sum(axis=-1) < tol).sum())


def read(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB")).astype(int)


def test_layout_size_and_pixels(tmp_path):
    colours = [(200, 0, 0), (0, 0, 200), (0, 150, 0), (90, 90, 90), (200, 0, 200), (0, 150, 150), (120, 60, 0)]
    # three ways a caller holds an image: PIL, PNG bytes (a data file's row), an array
    images = [solid(c) if i % 3 == 0 else png_bytes(solid(c)) if i % 3 == 1 else np.asarray(solid(c))
              for i, c in enumerate(colours)]
    captions = [["one line"]] * 7
    res = write_image_grid(tmp_path / "sub" / "grid.png", images, captions, columns=3, image_px=168)
    a = read(res.path)
    assert (res.columns, res.rows) == (3, 3)
    assert (a.shape[1], a.shape[0]) == res.size and res.size[0] == 3 * res.cell_width
    row_h = a.shape[0] // 3  # equal captions, equal rows
    # a 56 px picture fills the 168 px box at 3x (its box starts PAD = 8 below the row's top): the
    # middle and the corners of each cell's box are the picture's colour, not a small centred tile
    for i, rgb in enumerate(colours):
        r, c = divmod(i, 3)
        y, x = r * row_h + 8 + 84, c * res.cell_width + res.cell_width // 2
        for dy, dx in ((0, 0), (-83, -83), (83, 83)):
            assert tuple(a[y + dy, x + dx]) == rgb, (i, dy, dx)
        assert tuple(a[y - 86, x]) != rgb  # just outside the box: the frame
    assert (a[2 * row_h:, res.cell_width:] == 255).all()  # the empty eighth and ninth cells stay blank
    titled = write_image_grid(tmp_path / "t.png", images, captions, columns=3, title="validation")
    assert titled.size[0] == res.size[0] and titled.size[1] > res.size[1]
    band = read(titled.path)[:titled.size[1] - res.size[1]]
    assert (band < 128).any()  # the title's dark text is in the band above the pictures


def test_taller_captions_make_taller_rows(tmp_path):
    short = write_image_grid(tmp_path / "a.png", [solid((0, 0, 0))] * 2, [["x"], ["y"]], columns=2)
    tall = write_image_grid(tmp_path / "b.png", [solid((0, 0, 0))] * 2, [["x"], ["y", "z", "w"]], columns=2)
    assert short.size[0] == tall.size[0] and tall.size[1] > short.size[1]
    line_h = (tall.size[1] - short.size[1]) / 2
    assert 10 <= line_h <= 30  # two more lines of a 12 px font
    one_col = write_image_grid(tmp_path / "c.png", [solid((0, 0, 0))] * 2, [["x"], ["y"]], columns=1)
    assert one_col.size == (short.size[0] // 2, 2 * short.size[1])


def test_answers_are_green_when_right_and_red_when_wrong(tmp_path):
    lines = answer_lines("How many dots?", "3", {"before RL": ("4", False), "after RL": ("3", True)})
    assert lines[0] == "How many dots?" and lines[2] == ("before RL: 4", BAD) and lines[3] == ("after RL: 3", GOOD)
    all_right = answer_lines("How many dots?", "3", {"before RL": ("3", True), "after RL": ("3", True)})
    res = write_image_grid(tmp_path / "g.png", [solid((255, 255, 255))] * 2, [lines, all_right], columns=2)
    a = read(res.path)
    captions = a[8 + 168:]  # below the picture boxes
    left, right = captions[:, :res.cell_width], captions[:, res.cell_width:]
    assert near(left, GOOD) > 20 and near(left, BAD) > 20
    assert near(right, GOOD) > 40 and near(right, BAD) == 0
    assert answer_lines("q", "red", {"after": ("  ", False)})[-1] == ("after: (empty)", BAD)


def test_wrapping_stays_inside_the_cell():
    font = _font(12)
    text = "What colour is the largest shape? Supercalifragilisticexpialidociousanswerthatgoesonandon red"
    lines = _wrap(text, font, 120)
    assert len(lines) >= 4 and all(font.getlength(line) <= 120 for line in lines)
    assert "".join(line.rstrip("-") for line in lines).replace(" ", "") == text.replace(" ", "")
    assert _wrap("", font, 120) == [""] and _wrap("short", font, 120) == ["short"]


def test_mismatched_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="2 images and 1 captions"):
        write_image_grid(tmp_path / "x.png", [solid((0, 0, 0))] * 2, [["a"]])
    with pytest.raises(ValueError, match="0 images"):
        write_image_grid(tmp_path / "x.png", [], [])
    assert not (tmp_path / "x.png").exists()
