"""The synthetic arithmetic task of the CPU demo: "3+4=" -> "7" (data_source "synthetic_arith").

Why this task. The demo must show RL improving a tiny random-init model (hidden ~128, 2-4 layers)
by >= 30 accuracy points within minutes on 2 CPU cores. That needs:
- short prompts and answers: a prompt is ~5 characters and an answer 1-2, so a rollout is a few
  tokens and a GRPO step on 2 cores takes a fraction of a second;
- a finite set of facts: at difficulty 2 there are 100 sums, which a model of this size can hold;
  validation measures how many of them the greedy answer gets right;
- a reward that is exactly right or wrong (integer comparison), so no reward hacking or format
  learning gets in the way;
- a warm start that is *systematically* wrong. Uniformly random wrong labels would not do: the
  model would learn the right answer as the most likely one, greedy accuracy would already be high
  after SFT, and RL would have nothing to show. Here a fraction P (--sft-noise) of SFT rows carry
  the same distractor, the sum plus one. With P above 0.5 the distractor becomes the greedy answer
  where SFT has fit the data, while the right answer keeps about 1-P of the sampling probability: a
  group of rollouts (rollout.n) then contains right and wrong answers, GRPO gets a non-zero
  advantage on nearly every prompt, and greedy accuracy climbs as mass moves to the right answer.
  `--noise-kind random` (uniformly random wrong labels) is there for comparison.

Difficulty (--difficulty): 1: operands 0..4 (25 sums, all answers one digit); 2: 0..9 (100 sums,
"3+4=" -> "7"); k >= 3: 0..10^(k-1)-1 (k-1 digit operands; RL would take much longer).

Files written to OUT_DIR: train.parquet and val.parquet (prompt, data_source, ground_truth, extra)
for RL, and sft.parquet (the same columns plus `response`, the possibly wrong label, and
extra.noisy) for the warm start; the SFT trainer appends EOS to the response. Train, val and SFT
rows are drawn independently from the same distribution, so at low difficulty val sums also occur
in training: the demo measures fitting the right facts, not generalisation.
"""
from __future__ import annotations

import os
import random
from typing import Dict, List, Tuple

from verl_hpc.config.errors import ConfigError

DATA_SOURCE = "synthetic_arith"
NOISE_KINDS = ("systematic", "random")


def operand_max(difficulty: int) -> int:
    if difficulty < 1:
        raise ConfigError(f"--difficulty: must be >= 1, got {difficulty}")
    return 4 if difficulty == 1 else 10 ** (difficulty - 1) - 1


def _draw(rng: random.Random, hi: int) -> Tuple[int, int]:
    return rng.randint(0, hi), rng.randint(0, hi)


def task_row(a: int, b: int, difficulty: int) -> Dict:
    return {"data_source": DATA_SOURCE, "prompt": f"{a}+{b}=", "ground_truth": str(a + b),
            "extra": {"a": a, "b": b, "difficulty": difficulty}}


def wrong_answer(a: int, b: int, kind: str, rng: random.Random, hi: int) -> int:
    if kind == "systematic":
        return a + b + 1
    wrong = rng.randint(0, 2 * hi - 1)  # any other sum in range, uniformly
    return wrong if wrong < a + b else wrong + 1


def check_sizes(n_train: int, n_val: int, sft_noise: float, noise_kind: str) -> None:
    """The arguments every demo data set with a noisy SFT file takes (this one and prepare/visual.py)."""
    if n_train <= 0 or n_val <= 0:
        raise ConfigError(f"--n-train and --n-val: must be > 0, got {n_train} and {n_val}")
    if not 0.0 <= sft_noise <= 1.0:
        raise ConfigError(f"--sft-noise: a fraction in [0, 1], got {sft_noise}")
    if noise_kind not in NOISE_KINDS:
        raise ConfigError(f"--noise-kind: invalid value {noise_kind!r}; valid: {', '.join(NOISE_KINDS)}")


def generate(n_train: int, n_val: int, seed: int = 0, difficulty: int = 2, sft_noise: float = 0.0,
             n_sft: int = -1, noise_kind: str = "systematic") -> Dict[str, List[Dict]]:
    """{'train', 'val', 'sft'}: rows for each file. n_sft < 0 means as many as n_train."""
    check_sizes(n_train, n_val, sft_noise, noise_kind)
    hi = operand_max(difficulty)
    # one stream per file: adding val rows does not change the train rows
    rngs = {name: random.Random(f"synthetic_arith:{seed}:{name}") for name in ("train", "val", "sft")}
    out = {name: [task_row(*_draw(rngs[name], hi), difficulty) for _ in range(n)]
           for name, n in (("train", n_train), ("val", n_val))}
    sft = []
    for _ in range(n_train if n_sft < 0 else n_sft):
        a, b = _draw(rngs["sft"], hi)
        noisy = rngs["sft"].random() < sft_noise
        label = wrong_answer(a, b, noise_kind, rngs["sft"], hi) if noisy else a + b
        row = task_row(a, b, difficulty)
        row["response"] = str(label)
        row["extra"]["noisy"] = noisy
        sft.append(row)
    out["sft"] = sft
    return out


def write(out_dir: str, rows: Dict[str, List[Dict]]) -> Dict[str, str]:
    from verl_hpc.data.prepare.io import write_parquet

    paths = {name: os.path.join(out_dir, f"{name}.parquet") for name in rows}
    for name, path in paths.items():
        write_parquet(rows[name], path)
    return paths


def preference(n_train: int, n_val: int, seed: int = 0, difficulty: int = 2) -> Dict[str, List[Dict]]:
    """The preference task for `trainer.job: dpo`: for "a+b=", chosen = the sum, rejected = the sum
    plus one (the SFT warm start's systematic distractor, so a warm-started policy prefers the wrong
    answer and preference training has something to fix). Files: preference_train / preference_val
    (prompt, chosen, rejected) and kto_train (prompt, completion, label: each prompt once, with the
    right answer or the distractor at random)."""
    if n_train <= 0 or n_val <= 0:
        raise ConfigError(f"--n-train and --n-val: must be > 0, got {n_train} and {n_val}")
    hi = operand_max(difficulty)
    rngs = {name: random.Random(f"synthetic_pref:{seed}:{name}") for name in ("train", "val", "kto")}
    pair = lambda a, b: dict(task_row(a, b, difficulty), chosen=str(a + b), rejected=str(a + b + 1))  # noqa: E731
    out = {f"preference_{name}": [pair(*_draw(rngs[name], hi)) for _ in range(n)]
           for name, n in (("train", n_train), ("val", n_val))}
    kto = []
    for _ in range(n_train):
        a, b = _draw(rngs["kto"], hi)
        good = rngs["kto"].random() < 0.5
        kto.append(dict(task_row(a, b, difficulty), completion=str(a + b if good else a + b + 1), label=good))
    out["kto_train"] = kto
    return out
