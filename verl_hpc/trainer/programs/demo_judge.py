"""`make demo-judge`'s judge: a tiny causal LM trained here to say whether an answer to "a+b=" is
right, then the only reward of the policy's GRPO (configs/demo_judge.yaml).

    python -m verl_hpc.trainer.programs.demo_judge OUT    # OUT/judge_data/sft.parquet, OUT/judge_sft/hf, its accuracy

The judge's rows are what it sees in the RL run: reward.reward_model.judge.template (JUDGE_TEMPLATE,
also in configs/demo_judge.yaml) filled with the question as the policy's prompt decodes (the chat
template's text, special tokens left out) and a response: the right sum in half the rows, off by
one (the warm start's usual mistake) in a quarter, another number in the rest. The judge works it
out before it answers: its target is "<the right sum>:1" or "<the right sum>:0", and the verdict is
the digit after the colon (verdict = pattern, JUDGE_PATTERN). A one-token yes/no straight after the
question was measured first: the 2-layer model stayed at chance (46% held out) after 600 steps, as
it would have to add and compare in one position; writing the sum first leaves it a comparison.
The judge is SFT'd from a fresh tiny model of another seed (configs/demo_judge_sft.yaml,
data.wrap_plain_text false: its prompt is tokenized as the judge engine tokenizes it), then
measured on held-out rows with the judge engine itself (the parsed verdict against the truth).
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path
from typing import List

JUDGE_TEMPLATE = "{question}{response} ok?"
JUDGE_PATTERN = r":([01])"


def judge_rows(train_parquet: Path, tokenizer_path: Path, n: int, seed: int) -> List[dict]:
    import pandas as pd
    from transformers import AutoTokenizer

    from verl_hpc.data.templates import encode_prompts
    from verl_hpc.rewards.judge import render

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    src = pd.read_parquet(train_parquet)
    rng = random.Random(seed)
    picks = [src.iloc[rng.randrange(len(src))] for _ in range(n)]
    _, ids = encode_prompts(tok, [str(p["prompt"]) for p in picks], wrap_plain_text=True)
    rows = []
    for p, row_ids in zip(picks, ids):
        truth = int(p["ground_truth"])
        u = rng.random()
        answer = truth if u < 0.5 else truth + rng.choice((1, -1)) if u < 0.75 else rng.choice(
            [v for v in range(0, 19) if v != truth])
        question = tok.decode(row_ids, skip_special_tokens=True)
        rows.append({"data_source": "judge", "prompt": render(JUDGE_TEMPLATE, question, str(answer)),
                     "response": f"{truth}:{int(answer == truth)}", "ground_truth": "", "extra": {"right": answer == truth}})
    return rows


def judge_accuracy(judge_folder: Path, rows: List[dict]) -> float:
    """The share of rows whose parsed verdict (greedy, through the judge engine) is the truth; a
    verdict that does not parse counts as wrong."""
    import re

    from verl_hpc.rewards.judge import parse_score
    from verl_hpc.rollout.hf.judge import HFJudgeEngine

    eng, pattern = HFJudgeEngine(str(judge_folder)), re.compile(JUDGE_PATTERN)
    hits = 0
    for i in range(0, len(rows), 64):
        chunk = rows[i: i + 64]
        for text, r in zip(eng.generate([r["prompt"] for r in chunk], 6), chunk):
            hits += parse_score(text, pattern) == float(r["response"].endswith(":1"))
    return hits / len(rows)


def train_judge(out: Path, *, seed: int = 0, n: int = 12000, layers: int = 4, overrides=()) -> float:
    """Data, model and SFT of the judge under OUT; returns its held-out accuracy."""
    import pandas as pd

    py = sys.executable
    data = out / "judge_data"
    data.mkdir(parents=True, exist_ok=True)
    rows = judge_rows(out / "data" / "train.parquet", out / "model", n + 500, seed + 1)
    pd.DataFrame(rows[:n]).to_parquet(data / "sft.parquet")
    subprocess.run([py, "-m", "verl_hpc.models.tiny", str(out / "judge_model"), "--family", "llama", "--layers", str(layers),
                    "--seed", str(seed + 1)], check=True)
    subprocess.run([py, "-m", "verl_hpc.submit", "configs/demo_judge_sft.yaml", "--local",
                    f"model.path={out}/judge_model", f"data.sft_files=[{data}/sft.parquet]",
                    f"trainer.output_dir={out}/judge_sft", f"trainer.hf_output_dir={out}/judge_sft/hf", *overrides], check=True)
    return judge_accuracy(out / "judge_sft" / "hf", rows[n:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the demo's folder (holds data/train.parquet and model/)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    for need in ("data/train.parquet", "model/config.json"):
        if not (Path(a.out) / need).is_file():
            ap.error(f"OUT '{a.out}': no {need}; the demo's first steps make it (python -m "
                     "verl_hpc.trainer.programs.demo --task judge)")
    acc = train_judge(Path(a.out), seed=a.seed, overrides=a.overrides)
    print(f"judge accuracy on 500 held-out answers: {100 * acc:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
