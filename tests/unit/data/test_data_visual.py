"""The VLM demo's visual task: every answer re-derived from the picture's pixels, seeded rows, the
systematic SFT distractor, the command line."""
import io
import subprocess
import sys
from collections import Counter, deque

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from verl_hpc.config.errors import ConfigError
from verl_hpc.data.images import ImageLimits, load_images
from verl_hpc.data.prepare import visual
from verl_hpc.rewards.registry import get_scorer

WHITE = np.array([255, 255, 255])


def pixels(row):
    with Image.open(io.BytesIO(row["images"][0])) as img:
        assert img.format == "PNG" and img.mode == "RGB"
        return np.asarray(img).astype(int)


def ink(a):
    """Mask of the non-background pixels."""
    return (a != WHITE).any(axis=-1)


def components(mask):
    """Number of 8-connected components of a boolean mask (a plain flood fill)."""
    seen = np.zeros_like(mask)
    n = 0
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        n += 1
        seen[start] = True
        todo = deque([start])
        while todo:
            y, x = todo.popleft()
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    q = (y + dy, x + dx)
                    if 0 <= q[0] < mask.shape[0] and 0 <= q[1] < mask.shape[1] and mask[q] and not seen[q]:
                        seen[q] = True
                        todo.append(q)
    return n


def colour_areas(a):
    """{colour name: pixel count} by exact palette value; asserts nothing else was drawn."""
    areas = {name: int((a == np.array(rgb)).all(axis=-1).sum()) for name, rgb in visual.PALETTE.items()}
    assert sum(areas.values()) == int(ink(a).sum()), "a pixel that is neither background nor a palette colour"
    return areas


def answer_from_pixels(kind, a):
    """The answer a rule reads off the picture, independent of what the generator recorded."""
    if kind == "count":
        return str(components(ink(a)))
    if kind == "colour":
        areas = sorted(colour_areas(a).items(), key=lambda kv: -kv[1])
        assert areas[0][1] >= 1.5 * areas[1][1], f"largest shape not clearly largest: {areas}"
        return visual.LETTER[areas[0][0]]
    half = a.shape[1] // 2
    left, right = (int(ink(part).any(axis=1).sum()) for part in (a[:, :half], a[:, half:]))  # rows with ink
    assert abs(left - right) >= 0.15 * a.shape[0] - 1, (left, right)
    return "L" if left > right else "R"


@pytest.mark.parametrize("sizes", [(56, 84, 28), (48, 96, 16)])
def test_every_answer_matches_the_pixels(sizes):
    lo, hi, step = sizes
    rows = visual.generate(n_train=3, n_val=90, seed=7, min_size=lo, max_size=hi, size_step=step)["val"]
    assert Counter(r["extra"]["kind"] for r in rows) == {"count": 30, "colour": 30, "bar": 30}  # equal shares
    seen = Counter()
    for r in rows:
        kind = r["extra"]["kind"]
        a = pixels(r)
        assert (a.shape[1], a.shape[0]) == (r["extra"]["width"], r["extra"]["height"])
        assert a.shape[0] in range(lo, hi + 1, step) and a.shape[1] in range(lo, hi + 1, step)
        assert r["data_source"] == f"visual_{kind}" and r["prompt"] == visual.PROMPTS[kind]
        assert r["prompt"].count("<image>") == 1 == len(r["images"])
        assert r["ground_truth"] == answer_from_pixels(kind, a), (kind, r["extra"]["scene"])
        assert r["ground_truth"] in visual.ANSWERS[kind]
        seen[(kind, r["ground_truth"])] += 1
    # each answer of each kind occurs: the task is not one answer with a picture
    assert set(seen) == {(k, ans) for k, answers in visual.ANSWERS.items() for ans in answers}


def test_rows_load_and_score_through_the_project():
    rows = visual.generate(n_train=6, n_val=6, seed=1)["train"]
    for r in rows:
        (image,) = load_images(r["images"], ImageLimits.from_config())  # the loader's own decode and limits
        assert image.size == (r["extra"]["width"], r["extra"]["height"])
        scorer = get_scorer(r["data_source"])
        assert scorer.name == "visual" and scorer.check(r["ground_truth"]) is None
        assert scorer.fn(r["ground_truth"].upper() + ".", r["ground_truth"], r["extra"]) == 1.0


def test_seeded_and_one_stream_per_file():
    a = visual.generate(n_train=12, n_val=6, seed=3, sft_noise=0.5)
    assert a == visual.generate(n_train=12, n_val=6, seed=3, sft_noise=0.5)  # PNG bytes included
    assert visual.generate(n_train=12, n_val=9, seed=3, sft_noise=0.5)["train"] == a["train"]
    other = visual.generate(n_train=12, n_val=6, seed=4, sft_noise=0.5)
    assert [r["images"] for r in other["train"]] != [r["images"] for r in a["train"]]


def test_sft_noise_is_one_systematic_distractor():
    clean = visual.generate(n_train=30, n_val=3, seed=2, sft_noise=0.0)["sft"]
    assert all(r["response"] == r["ground_truth"] and not r["extra"]["noisy"] for r in clean)
    noisy = visual.generate(n_train=30, n_val=3, seed=2, sft_noise=1.0)["sft"]
    expected = {"count": {"1": "2", "2": "3", "3": "4", "4": "1"},
                "colour": {"R": "G", "G": "B", "B": "R"},
                "bar": {"L": "R", "R": "L"}}
    for r in noisy:
        assert r["extra"]["noisy"] and r["response"] == expected[r["extra"]["kind"]][r["ground_truth"]]
    mixed = visual.generate(n_train=600, n_val=3, seed=2, sft_noise=0.7)["sft"]
    share = sum(r["response"] != r["ground_truth"] for r in mixed) / len(mixed)
    assert 0.64 < share < 0.76 and all(r["extra"]["noisy"] == (r["response"] != r["ground_truth"]) for r in mixed)


def test_random_noise_spreads_over_the_wrong_answers():
    rows = visual.generate(n_train=120, n_val=3, seed=5, sft_noise=1.0, noise_kind="random", kinds="count")["sft"]
    assert all(r["response"] != r["ground_truth"] and r["response"] in visual.ANSWERS["count"] for r in rows)
    wrong_for_1 = {r["response"] for r in rows if r["ground_truth"] == "1"}
    assert wrong_for_1 == {"2", "3", "4"}


@pytest.mark.parametrize("kwargs,message", [
    (dict(kinds="count,shape"), "--kinds: invalid value shape; valid: a comma-separated subset of count,colour,bar"),
    (dict(kinds=""), "--kinds: invalid value"),
    (dict(min_size=32), "--min-size/--max-size/--size-step: need 48 <= min <= max"),
    (dict(min_size=84, max_size=56), "need 48 <= min <= max"),
    (dict(size_step=0), "step >= 1"),
    (dict(noise_kind="uniform"), "--noise-kind: invalid value 'uniform'"),
    (dict(sft_noise=1.5), "--sft-noise: a fraction in [0, 1]"),
    (dict(n_val=0), "--n-train and --n-val: must be > 0"),
])
def test_bad_options_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        visual.generate(**dict(dict(n_train=3, n_val=3), **kwargs))


@pytest.mark.heavy
def test_cli_writes_the_three_files(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "visual", str(tmp_path), "--n-train", "9",
                           "--n-val", "6", "--seed", "2", "--sft-noise", "0.6", "--kinds", "bar,count",
                           "--min-size", "64", "--max-size", "96", "--size-step", "32"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {name: pq.read_table(tmp_path / f"{name}.parquet").to_pylist() for name in ("train", "val", "sft")}
    assert [len(rows[n]) for n in ("train", "val", "sft")] == [9, 6, 9]
    expected = visual.generate(9, 6, seed=2, sft_noise=0.6, kinds="bar,count", min_size=64, max_size=96, size_step=32)
    for name in rows:  # the file holds what the function returns
        assert [r["images"] for r in rows[name]] == [r["images"] for r in expected[name]]
        assert [r["ground_truth"] for r in rows[name]] == [r["ground_truth"] for r in expected[name]]
    assert {r["data_source"] for r in rows["val"]} == {"visual_bar", "visual_count"}
    assert all("response" in r for r in rows["sft"])
    bad = subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "visual", str(tmp_path / "x"), "--kinds", "dots"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --kinds: invalid value dots") and "Traceback" not in bad.stderr
