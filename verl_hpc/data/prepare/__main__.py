"""`python -m verl_hpc.data.prepare {gsm8k,math,synthetic,tool_arith,visual} ...`: see verl_hpc/data/prepare/__init__.py.

A problem is one `error: ...` line and its class's exit code (docs/errors.md): 10 for input rows
or files (DataError, the file and line named), 2 for an option value or an output path that
cannot be written (ConfigError).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from verl_hpc.data.prepare.synthetic import NOISE_KINDS
from verl_hpc.errors import VerlHpcError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_hpc.data.prepare", description=__doc__)
    sub = p.add_subparsers(dest="task", required=True)
    for task, fmt in (("gsm8k", "question, answer ending with '#### <number>'"),
                      ("math", "problem, solution with \\boxed{answer}")):
        s = sub.add_parser(task, help=f"public {task} JSONL ({fmt}) -> prompt parquet")
        s.add_argument("input", help="JSONL (or parquet) file in the public format")
        s.add_argument("output", help="parquet file to write")
        s.add_argument("--instruction", default=None, help="text appended to every prompt")
    s = _generated(sub, "synthetic", "synthetic arithmetic task for CPU runs: train/val/sft parquet", 200,
                   "fraction of SFT rows with a wrong label")
    s.add_argument("--difficulty", type=int, default=2, help="1: operands 0..4, 2: 0..9, k: 0..10^(k-1)-1")
    s.add_argument("--noise-kind", default="systematic", choices=NOISE_KINDS)
    s.add_argument("--preference", action="store_true",
                   help="also write preference_train/preference_val (prompt, chosen, rejected) and "
                        "kto_train (prompt, completion, label) for trainer.job=dpo")
    _generated(sub, "tool_arith", "the tool demo: 5-digit products, multi-turn SFT demonstrations", 100,
               "fraction of SFT rows answering without the tool")
    s = _generated(sub, "visual", "the VLM demo: small Pillow pictures (count, colour, bar) with one-word answers", 60,
                   "fraction of SFT rows with a wrong label")
    s.add_argument("--kinds", default="count,colour,bar", help="comma-separated subset of count,colour,bar")
    s.add_argument("--noise-kind", default="systematic", choices=NOISE_KINDS)
    s.add_argument("--min-size", type=int, default=56, help="smallest picture side (pixels)")
    s.add_argument("--max-size", type=int, default=84, help="largest picture side (pixels)")
    s.add_argument("--size-step", type=int, default=28,
                   help="sides are min, min+step, ... <= max (28: Qwen2.5-VL's merged patch; 32 for Qwen3-VL)")
    return p


def _generated(sub, task: str, help: str, n_val: int, noise_help: str) -> argparse.ArgumentParser:
    """A generated task's subcommand: the options every generator takes (sizes, seed, SFT noise)."""
    s = sub.add_parser(task, help=help)
    s.add_argument("out_dir")
    s.add_argument("--n-train", type=int, default=2000)
    s.add_argument("--n-val", type=int, default=n_val)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--sft-noise", type=float, default=0.0, help=noise_help)
    s.add_argument("--n-sft", type=int, default=-1, help="SFT rows (default: --n-train)")
    return s


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from verl_hpc.data.prepare.io import write_parquet

    try:
        if args.task == "synthetic":
            from verl_hpc.data.prepare import synthetic

            rows = synthetic.generate(args.n_train, args.n_val, args.seed, args.difficulty, args.sft_noise,
                                      args.n_sft, args.noise_kind)
            if args.preference:
                rows.update(synthetic.preference(args.n_train, args.n_val, args.seed, args.difficulty))
            for name, path in synthetic.write(args.out_dir, rows).items():
                print(f"wrote {len(rows[name])} rows to {path}")
            return 0
        if args.task == "tool_arith":
            from verl_hpc.data.prepare import synthetic, tool_arith

            rows = tool_arith.generate(args.n_train, args.n_val, args.seed, args.sft_noise, args.n_sft)
            for name, path in synthetic.write(args.out_dir, rows).items():
                print(f"wrote {len(rows[name])} rows to {path}")
            return 0
        if args.task == "visual":
            from verl_hpc.data.prepare import synthetic, visual

            rows = visual.generate(args.n_train, args.n_val, args.seed, args.sft_noise, args.n_sft, args.noise_kind,
                                   args.kinds, args.min_size, args.max_size, args.size_step)
            for name, path in synthetic.write(args.out_dir, rows).items():
                print(f"wrote {len(rows[name])} rows to {path}")
            return 0
        if args.task == "gsm8k":
            from verl_hpc.data.prepare.gsm8k import INSTRUCTION, gsm8k_rows as convert
        else:
            from verl_hpc.data.prepare.competition_math import INSTRUCTION, math_rows as convert
        rows = convert(args.input, args.instruction if args.instruction is not None else INSTRUCTION)
        write_parquet(rows, args.output)
        print(f"wrote {len(rows)} {args.task} rows to {args.output}")
        return 0
    except VerlHpcError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
