"""The synthetic visual task of the VLM demo: small Pillow pictures with a one-word answer.

Kinds (--kinds, any of them; rows cycle through the chosen kinds in order, so every file holds
them in equal shares):
- count: 1..4 dots of one colour on white, "How many dots?" -> "1".."4" (data_source visual_count);
- colour: 2 or 3 shapes (squares, circles) of different colours, one clearly the largest (at least
  1.5x the area of any other), "What colour is the largest shape?" -> R / G / B for red, green,
  blue (visual_colour);
- bar: two bars standing on one baseline, heights differing by at least 15% of the picture,
  "Which bar is taller?" -> L / R for left, right (visual_bar).
Shapes never overlap or touch, and everything is drawn without anti-aliasing, so a rule reading
the pixels (the tests do) finds the same answer as the generator.

Why this task. The demo must show RL improving a tiny random-init vision-language model on 2 CPU
cores within minutes, so the pictures are small and the answers one token: a side is drawn from
--min-size .. --max-size in steps of --size-step (default 56, 84 and 28 px, the merged patch of
Qwen2.5-VL: a 56 x 56 picture is 4 image tokens and 84 x 84 is 9, with no resize), an answer is a digit or
a capital letter, so a rollout is two tokens (the answer, EOS) and the reward is exactly right or
wrong (verl_hpc/rewards/basic.py first_word_score, the `visual` scorer). Letters rather than words
because the tiny models' tokenizer spells "red" and "right" letter by letter: their shared first
token blurred the two answers, and RL then drove the blue questions to "rigggg" (measured). For
Qwen3-VL (16 px patches) use steps of 32 (64, 96).

What the tiny Qwen2.5-VL of the demo learns (measured, SFT on 12,000 clean rows, 2 epochs): the
colour of the largest shape, 100%; the taller bar, 50% (chance: with 4-9 image tokens it does
not learn to compare the bars); so `make demo-vlm` asks colour questions only.

The warm start is *systematically* wrong, for the reason the arithmetic task's is (see
verl_hpc/data/prepare/synthetic.py): a fraction P (--sft-noise, above 0.5 for the demo) of SFT rows
carry one fixed distractor per answer (count: n+1, 4 -> 1; colour: red -> green -> blue -> red;
bar: the other side), so after SFT the greedy answer is the distractor where the model has learnt
the picture, while the right answer keeps about 1-P of the sampling mass and a group of rollouts
holds both: GRPO has an advantage to follow. `--noise-kind random` draws any wrong answer instead.

Files written to OUT_DIR: train.parquet and val.parquet (prompt with an `<image>` placeholder,
images = [PNG bytes], data_source, ground_truth, extra = {kind, width, height, scene: the drawn
shapes as JSON}) and sft.parquet (the same plus `response` and extra.noisy). Each file is its own
random stream from --seed: everything is a pure function of the arguments.
"""
from __future__ import annotations

import json
import random
from typing import Dict, List, Sequence, Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.vision import PLACEHOLDER
from verl_hpc.data.prepare.synthetic import check_sizes

DATA_SOURCE = "visual"  # rows carry visual_<kind>; the reward routes the prefix (rewards/registry.py)
KINDS = ("count", "colour", "bar")
BACKGROUND = (255, 255, 255)
# saturated and far apart, so a colour is unambiguous to a model and to a pixel count
PALETTE: Dict[str, Tuple[int, int, int]] = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 70, 220)}
MAX_DOTS = 4
MIN_SIDE = 48  # below this, 4 dots or 3 shapes no longer fit apart with room to spare
PROMPTS = {
    "count": f"{PLACEHOLDER}How many dots? Answer with a number.",
    "colour": f"{PLACEHOLDER}What colour is the largest shape? Answer R (red), G (green) or B (blue).",
    "bar": f"{PLACEHOLDER}Which bar is taller? Answer L (left) or R (right).",
}
SIDES = ("left", "right")
LETTER = {name: name[0].upper() for name in (*PALETTE, *SIDES)}  # the one-token answer of a colour or side
ANSWERS = {"count": tuple(str(n) for n in range(1, MAX_DOTS + 1)), "colour": tuple(LETTER[c] for c in PALETTE),
           "bar": tuple(LETTER[s] for s in SIDES)}
GAP = 3  # pixels of background kept between any two shapes: they stay separate components


def _overlaps(box, boxes, gap: int = GAP) -> bool:
    x0, y0, x1, y1 = box
    return any(x0 <= b[2] + gap and b[0] <= x1 + gap and y0 <= b[3] + gap and b[1] <= y1 + gap for b in boxes)


def _place(rng: random.Random, extents: Sequence[Tuple[int, int]], width: int, height: int) -> List[Tuple[int, int, int, int]]:
    """Non-overlapping boxes (x0, y0, x1, y1, inclusive) of the given (w, h) inside the picture,
    one margin from its border; rejection sampling, which the sizes chosen by the callers make
    succeed within a few tries (MIN_SIDE leaves room for the largest scene twice over)."""
    for _ in range(200):
        boxes = []
        for w, h in extents:
            for _ in range(100):
                x0, y0 = rng.randint(2, width - w - 2), rng.randint(2, height - h - 2)
                box = (x0, y0, x0 + w - 1, y0 + h - 1)
                if not _overlaps(box, boxes):
                    boxes.append(box)
                    break
            else:
                break
        if len(boxes) == len(extents):
            return boxes
    raise RuntimeError(f"could not place {len(extents)} shapes in {width}x{height}")  # unreachable above MIN_SIDE


def _count(rng: random.Random, draw, width: int, height: int) -> Tuple[str, Dict]:
    n = rng.randint(1, MAX_DOTS)
    radius = rng.randint(3, max(3, min(width, height) // 12))
    colour = rng.choice(list(PALETTE))
    boxes = _place(rng, [(2 * radius + 1, 2 * radius + 1)] * n, width, height)
    for box in boxes:
        draw.ellipse(box, fill=PALETTE[colour])
    return str(n), {"colour": colour, "radius": radius, "boxes": boxes}


def _colour(rng: random.Random, draw, width: int, height: int) -> Tuple[str, Dict]:
    side = min(width, height)
    colours = rng.sample(list(PALETTE), rng.randint(2, 3))
    # the largest spans 38-48% of the short side, the others 14-24%: even a circle (pi/4 of its
    # box) against a square of the other size keeps an area ratio of 1.5 or more after rounding
    sizes = [rng.randint(round(0.38 * side), round(0.48 * side))]
    sizes += [rng.randint(round(0.14 * side), round(0.24 * side)) for _ in colours[1:]]
    shapes = [rng.choice(("square", "circle")) for _ in colours]
    boxes = _place(rng, [(s, s) for s in sizes], width, height)
    for colour, shape, box in zip(colours, shapes, boxes):
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=PALETTE[colour])
    return LETTER[colours[0]], {"shapes": [{"colour": c, "shape": s, "box": b} for c, s, b in zip(colours, shapes, boxes)]}


def _bar(rng: random.Random, draw, width: int, height: int) -> Tuple[str, Dict]:
    base = height - 3  # the bars stand on this row
    lo, hi, apart = round(0.2 * height), base - 3, max(2, round(0.15 * height))
    while True:
        heights = [rng.randint(lo, hi), rng.randint(lo, hi)]
        if abs(heights[0] - heights[1]) >= apart:
            break
    bar_w = max(4, width // 5)
    boxes = []
    for half, h in enumerate(heights):
        x0 = half * width // 2 + (width // 2 - bar_w) // 2
        boxes.append((x0, base - h + 1, x0 + bar_w - 1, base))
    colours = [rng.choice(list(PALETTE)) for _ in heights]
    for colour, box in zip(colours, boxes):
        draw.rectangle(box, fill=PALETTE[colour])
    return LETTER[SIDES[0] if heights[0] > heights[1] else SIDES[1]], {"heights": heights, "colours": colours, "boxes": boxes}


_DRAW = {"count": _count, "colour": _colour, "bar": _bar}


def picture(kind: str, rng: random.Random, width: int, height: int):
    """(the RGB PIL image, its answer, what was drawn) of one `kind` task."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), BACKGROUND)
    answer, scene = _DRAW[kind](rng, ImageDraw.Draw(image), width, height)
    return image, answer, scene


def sides(min_size: int, max_size: int, size_step: int) -> List[int]:
    if min_size < MIN_SIDE or max_size < min_size or size_step < 1:
        raise ConfigError(f"--min-size/--max-size/--size-step: need {MIN_SIDE} <= min <= max and step >= 1, got "
                          f"{min_size}, {max_size}, {size_step}")
    return list(range(min_size, max_size + 1, size_step))


def task_row(kind: str, rng: random.Random, side_choices: Sequence[int]) -> Dict:
    from verl_hpc.data.images import png_bytes

    width, height = rng.choice(side_choices), rng.choice(side_choices)
    image, answer, scene = picture(kind, rng, width, height)
    return {"data_source": f"{DATA_SOURCE}_{kind}", "prompt": PROMPTS[kind], "images": [png_bytes(image)],
            "ground_truth": answer,
            "extra": {"kind": kind, "width": width, "height": height, "scene": json.dumps(scene)}}


def wrong_answer(kind: str, answer: str, noise_kind: str, rng: random.Random) -> str:
    """The systematic distractor (the next answer of the kind's list, cyclically) or any other."""
    options = ANSWERS[kind]
    if noise_kind == "systematic":
        return options[(options.index(answer) + 1) % len(options)]
    return rng.choice([o for o in options if o != answer])


def parse_kinds(kinds: str | Sequence[str]) -> Tuple[str, ...]:
    names = tuple(k.strip() for k in (kinds.split(",") if isinstance(kinds, str) else kinds) if k.strip())
    bad = [k for k in names if k not in KINDS]
    if bad or not names:
        raise ConfigError(f"--kinds: invalid value {','.join(bad) or repr(kinds)}; valid: a comma-separated "
                          f"subset of {','.join(KINDS)}")
    return names


def generate(n_train: int, n_val: int, seed: int = 0, sft_noise: float = 0.0, n_sft: int = -1,
             noise_kind: str = "systematic", kinds: str | Sequence[str] = KINDS, min_size: int = 56,
             max_size: int = 84, size_step: int = 28) -> Dict[str, List[Dict]]:
    """{'train', 'val', 'sft'}: rows for each file. n_sft < 0 means as many as n_train."""
    check_sizes(n_train, n_val, sft_noise, noise_kind)
    kinds, side_choices = parse_kinds(kinds), sides(min_size, max_size, size_step)
    # one stream per file: adding val rows does not change the train rows
    rngs = {name: random.Random(f"{DATA_SOURCE}:{seed}:{name}") for name in ("train", "val", "sft")}
    out = {name: [task_row(kinds[i % len(kinds)], rngs[name], side_choices) for i in range(n)]
           for name, n in (("train", n_train), ("val", n_val))}
    sft = []
    for i in range(n_train if n_sft < 0 else n_sft):
        row = task_row(kinds[i % len(kinds)], rngs["sft"], side_choices)
        noisy = rngs["sft"].random() < sft_noise
        kind, answer = row["extra"]["kind"], row["ground_truth"]
        row["response"] = wrong_answer(kind, answer, noise_kind, rngs["sft"]) if noisy else answer
        row["extra"]["noisy"] = noisy
        sft.append(row)
    out["sft"] = sft
    return out
