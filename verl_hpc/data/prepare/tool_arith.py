"""The tool demo's task: products of two 5-digit numbers (data_source "tool_arith").

Why this task. A tiny model cannot multiply 5-digit numbers (a product has 9-10 digits and the
model holds no multiplication table), so answering directly is right about never; with the
`calculator` tool it needs only to copy: the operands into the call, the tool's output into the
answer. Accuracy then measures whether the model uses the tool, and uses it well.

The warm start. SFT rows are multi-turn demonstrations (verl_hpc/trainer/programs/sft.py): the assistant
calls `calculator`, the tool turn holds the product, the assistant repeats it. A fraction
(--sft-noise, > 0.5) of rows answer directly instead, "about <a made-up 9-digit number>", so the
warm start answers directly when greedy (validation accuracy near 0) while still calling the tool in
a good share of its samples. The direct answers share their first word on purpose: with random
digits first, the tool call's "<" would be the single most likely first token and greedy decoding
would call the tool from the start (the demo's arith task uses one systematic distractor likewise). GRPO rewards the episodes that called the tool and copied right, and the
tool-call rate and accuracy rise together: a rise that only tool use can explain.

Files written to OUT_DIR: train.parquet, val.parquet (prompt, data_source, ground_truth, extra) and
sft.parquet (the same plus `response`: a list of messages).
"""
from __future__ import annotations

import json
import random
from typing import Dict, List

from verl_hpc.config.errors import ConfigError

DATA_SOURCE = "tool_arith"
LOW, HIGH = 10_000, 99_999  # 5-digit operands


def task_row(a: int, b: int) -> Dict:
    return {"data_source": DATA_SOURCE, "prompt": f"{a}*{b}=", "ground_truth": str(a * b),
            "extra": {"a": a, "b": b}, "tools": ["calculator"]}


def tool_call(a: int, b: int) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}) + "</tool_call>"


def demonstration(a: int, b: int) -> List[Dict[str, str]]:
    """The episode the SFT rows teach: call, tool output, answer."""
    return [{"role": "assistant", "content": tool_call(a, b)},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


def generate(n_train: int, n_val: int, seed: int = 0, sft_noise: float = 0.0, n_sft: int = -1) -> Dict[str, List[Dict]]:
    """{'train', 'val', 'sft'} rows; n_sft < 0: as many as n_train."""
    if n_train <= 0 or n_val <= 0:
        raise ConfigError(f"--n-train and --n-val: must be > 0, got {n_train} and {n_val}")
    if not 0.0 <= sft_noise <= 1.0:
        raise ConfigError(f"--sft-noise: a fraction in [0, 1], got {sft_noise}")
    rngs = {name: random.Random(f"{DATA_SOURCE}:{seed}:{name}") for name in ("train", "val", "sft")}
    draw = lambda rng: (rng.randint(LOW, HIGH), rng.randint(LOW, HIGH))  # noqa: E731
    out = {name: [task_row(*draw(rngs[name])) for _ in range(n)] for name, n in (("train", n_train), ("val", n_val))}
    sft = []
    for _ in range(n_train if n_sft < 0 else n_sft):
        rng = rngs["sft"]
        a, b = draw(rng)
        direct = rng.random() < sft_noise
        row = task_row(a, b)
        row["response"] = ([{"role": "assistant", "content": f"about {rng.randint(10**8, 10**9 - 1)}"}]
                           if direct else demonstration(a, b))
        row["extra"]["direct"] = direct
        sft.append(row)
    out["sft"] = sft
    return out
