"""`bench_async.py simulate`: colocated-synchronous against split-asynchronous RL on the simulated
clock (model.py says what it models), the best split of the GPUs per staleness bound."""
from __future__ import annotations

import json
from pathlib import Path

from verl_hpc.config import ConfigError

from .common import ROOT, _ks, base_config, candidates, check_args, describe, placement_from_plan, split_config
from .model import lognormal_lengths, simulate


def best_split(args, base, lengths, k: int, colocated_step: float) -> dict:
    """The split (of candidates()) with the most steps per hour at staleness k."""
    best, refused = None, []
    for r in candidates(args, base):
        try:
            cfg = split_config(base, r, k)
        except ConfigError as err:
            if args.rollout_gpus:
                raise ConfigError(f"--rollout-gpus {r}: {err}") from None
            refused.append(f"{r} rollout GPUs: {err}")
            continue
        p = placement_from_plan(cfg, float(lengths.mean()), args.prompt_tokens, args.decode_mfu)
        res = simulate(p, lengths, cfg.rollout.n, k, args.warmup, steps=args.steps)
        row = dict(k=k, rollout_gpus=r, train_gpus=cfg.train_world_size, step_s=res.step_s,
                   steps_per_hour=res.steps_per_hour, speedup=colocated_step / res.step_s,
                   rollout_idle=res.rollout_idle, train_idle=res.train_idle,
                   mean_staleness=res.mean_staleness, max_staleness=max(res.staleness),
                   model=describe(cfg, p))
        if best is None or row["step_s"] < best["step_s"]:
            best = row
    if best is None:
        raise ConfigError(f"no split of --gpus {args.gpus} is a valid layout: " + "; ".join(refused))
    return best


def run_simulate(args) -> int:
    check_args(args)
    ks = _ks(args.ks)
    cfg = base_config(args)
    if args.prompt_tokens is None:
        args.prompt_tokens = cfg.data.max_prompt_length
    rows = cfg.data.train_batch_size * cfg.rollout.n
    lengths = lognormal_lengths(args.steps + max(ks) + 1, rows, args.len_median, args.len_sigma,
                                cfg.data.max_response_length, args.seed)
    colo_p = placement_from_plan(cfg, float(lengths.mean()), args.prompt_tokens, args.decode_mfu)
    colo = simulate(colo_p, lengths, cfg.rollout.n, 0, args.warmup, steps=args.steps, overlapped=False)
    splits = [best_split(args, cfg, lengths, k, colo.step_s) for k in ks]
    out = dict(gpus=args.gpus, model=args.model, gpu_type=cfg.slurm.gpu_type, config=str(args.config),
               prompts=cfg.data.train_batch_size, n=cfg.rollout.n, prompt_tokens=args.prompt_tokens,
               max_tokens=cfg.data.max_response_length, len_median=args.len_median,
               len_sigma=args.len_sigma, mean_length=float(lengths.mean()), steps=args.steps,
               warmup=args.warmup, seed=args.seed, decode_mfu=args.decode_mfu,
               colocated=dict(step_s=colo.step_s, steps_per_hour=colo.steps_per_hour,
                              model=describe(cfg, colo_p)),
               split=splits)
    print_table(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def print_table(out: dict) -> None:
    print(f"simulated: {out['gpus']} x {out['gpu_type']}, {out['model']}, {out['prompts']} prompts x "
          f"{out['n']}, responses lognormal (median {out['len_median']:g}, sigma {out['len_sigma']:g}, "
          f"mean {out['mean_length']:.0f}, max {out['max_tokens']}), {out['steps'] - out['warmup']} "
          f"steps after {out['warmup']}")
    print(f"colocated-sync: {out['colocated']['step_s']:.1f} s/step; {out['colocated']['model']}")
    print(f"{'k':>3} {'rollout/train GPUs':>19} {'speedup':>8} {'rollout idle':>13} {'train idle':>11} "
          f"{'staleness mean/max':>19}")
    for r in out["split"]:
        print(f"{r['k']:>3} {str(r['rollout_gpus']) + ' / ' + str(r['train_gpus']):>19} "
              f"{r['speedup']:>7.2f}x {r['rollout_idle']:>13.0%} {r['train_idle']:>11.0%} "
              f"{r['mean_staleness']:>14.2f} / {r['max_staleness']}")


def add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="simulated clock, no model: colocated-sync vs split-async")
    p.add_argument("--config", default=str(ROOT / "configs" / "grpo_8b.yaml"),
                   help="the job config whose plan times the steps (default: configs/grpo_8b.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted config override (repeatable), e.g. --set slurm.gpu_type=h200")
    p.add_argument("--model", default="qwen2.5-7b", help="model.path: a folder or a name the plan knows")
    p.add_argument("--gpus", type=int, default=64, help="GPUs of the job (whole nodes)")
    p.add_argument("--rollout-gpus", type=int, default=0, help="GPUs that roll out in split (0: the best split)")
    p.add_argument("--ks", default="0,1,2,4", help="staleness bounds k to simulate")
    p.add_argument("--batch", type=int, default=None, help="data.train_batch_size (default: the config's)")
    p.add_argument("--n", type=int, default=None, help="rollout.n (default: the config's)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="data.max_response_length: where lengths are clipped (default: the config's)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="tokens per prompt (default: data.max_prompt_length)")
    p.add_argument("--len-median", type=float, default=1000.0, help="median response length (tokens)")
    p.add_argument("--len-sigma", type=float, default=1.0, help="lognormal sigma of response lengths; 0: constant")
    p.add_argument("--decode-mfu", type=float, default=None,
                   help="the decode MFU behind beta (default: the plan's assumption), to see how much rides on it")
    p.add_argument("--steps", type=int, default=16, help="RL steps simulated")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.set_defaults(func=run_simulate)
