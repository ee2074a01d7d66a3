"""Greedy accuracy of a Hugging Face model folder on a prompt parquet, independently of the engines:
transformers' own generate (greedy), the project's chat-template rendering and reward functions.

    python -m verl_hpc.trainer.programs.greedy_eval MODEL_DIR VAL_PARQUET [--max-new-tokens 4]

Used to show that preference training changes what the policy answers (trainer.job=dpo reports
preference accuracy; this measures the answers themselves). A MODEL_DIR without config.json is one
`error: ...` line and exit code 2, a VAL_PARQUET that cannot be read one line and 10 (docs/errors.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Tuple


def greedy_answers(model_dir: str, val_file: str, max_new_tokens: int, prompt_key: str,
                   wrap_plain_text: bool) -> List[Tuple[dict, str]]:
    """(row, the model's greedy answer text) for every row of `val_file`; a vision-language model's
    rows bring their images (the `images` column) through its processor."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from verl_hpc.data import encode_prompts, read_rows
    from verl_hpc.data.processor import ImagePrompts, VisionProcessor, token_types

    tok = AutoTokenizer.from_pretrained(model_dir)
    vision = VisionProcessor.load(model_dir)
    auto = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = read_rows(val_file, what="val file")
    if vision is not None:
        images = ImagePrompts(vision)
        base = os.path.dirname(os.path.abspath(val_file))
        made = [images.encode(r[prompt_key], r.get(images.image_key), base) for r in rows]
        prompts = [ids for _, ids, _ in made]
        extras = [dict(m.inputs) if m is not None else {} for _, _, m in made]
    else:
        _, prompts = encode_prompts(tok, [r[prompt_key] for r in rows], wrap_plain_text)
        extras = [{} for _ in rows]
    answers = []
    with torch.no_grad():
        for row, ids, extra in zip(rows, prompts, extras):
            x = torch.tensor([ids])
            if extra:
                extra["mm_token_type_ids"] = token_types(x, vision.image_token_id)
            out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, **extra,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or tok.eos_token_id)
            answers.append((row, tok.decode(out[0, len(ids):], skip_special_tokens=True)))
    return answers


def greedy_accuracy(model_dir: str, val_file: str, max_new_tokens: int, prompt_key: str,
                    wrap_plain_text: bool) -> float:
    from verl_hpc.rewards import default_score

    answers = greedy_answers(model_dir, val_file, max_new_tokens, prompt_key, wrap_plain_text)
    right = sum(float(default_score(row["data_source"], text, str(row["ground_truth"])) > 0) for row, text in answers)
    return right / max(len(answers), 1)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("val_file")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    a = ap.parse_args(argv)
    from verl_hpc.config import JobConfig
    from verl_hpc.config.hf_model import read_hf_config
    from verl_hpc.data import read_rows
    from verl_hpc.errors import VerlHpcError

    d = JobConfig().data  # the default data section's prompt column and chat-template wrapping
    try:  # the arguments first, before transformers turns a missing folder into a hub lookup
        read_hf_config(a.model_dir, "MODEL_DIR")
        read_rows(a.val_file, what="val file")
        accuracy = greedy_accuracy(a.model_dir, a.val_file, a.max_new_tokens, d.prompt_key, d.wrap_plain_text)
    except VerlHpcError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps({"greedy_accuracy": accuracy}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
