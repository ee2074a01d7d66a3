"""`bench_async.py simulate-elastic`: colocated, fixed split and fixed split + an elastic backfill pool
on a simulated cluster, the same random draws for all three.

    python benchmarks/bench_async.py simulate-elastic                      # 8 own nodes of a 64-node cluster
    python benchmarks/bench_async.py simulate-elastic --seeds 0 --target-steps 60 --plot pool.png
    python benchmarks/bench_async.py simulate-elastic --kill-fraction 0 --slow-fraction 0 --continue

The cluster: --cluster-nodes nodes of slurm.gpus_per_node GPUs; the run holds --gpus of them (its
own: training + fixed rollout, or colocated); every other node is busy with other users' jobs but
for its backfill windows (backfill.py: the shape and its source), in each of which the pool's
workers run, one per GPU at rollout.tp 1 as the runtime's workers do (docs/elastic.md). The run's
steps are timed by the memory/step-time plan as in `simulate` (model.py's docstring); the
pool's rules are elastic_sim.py's, with the config's placement.elastic (straggler_deadline_s,
heartbeat_timeout_s, lost_samples) unless --deadline, --heartbeat or --continue say otherwise.

A node's start-up: --start-s (the jobs' start and the vLLM engines' build: vLLM reports 14-40 s
of engine initialisation for Llama-3-8B, vllm-project/vllm#11005, and ~60 s from start to a first
answer for a small model, #20264; 90 s by default, with the job's own start) + the checkpoint its
engines load (gpus_per_node x the model's bytes) read at --load-gbps (default 5 GB/s, one node's
share of a parallel filesystem) + the live weights from the first training rank over its one link
(the plan's inter-node bandwidth).

Per seed: one draw of response lengths and one of windows, shared by the three placements; the
splits (rollout GPUs of the run's own) are searched as `simulate` does, the fixed and the elastic
one separately, each the best on the mean over seeds. Reported, over the steps after --warmup:
samples trained per hour; time to --target-steps (from t = 0); rollout GPU-hours per 1,000 trained
samples (own rollout GPUs, or for colocated the GPUs' time outside training and syncs, plus every
backfill GPU held, start-up included); samples re-dispatched (stragglers), handed back (leaves) and
generated twice; tokens generated / trained; the oldest token's staleness (<= k by the rule).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Dict, List

import numpy as np

from verl_hpc.config import ConfigError

from .backfill import IDLE_FRACTION, WINDOW_MEDIAN_S, WINDOW_SIGMA, BackfillModel, idle_nodes
from .common import ROOT, base_config, candidates, check_args, placement_from_plan, split_config
from .elastic_sim import ElasticSim, Setup
from .model import lognormal_lengths


def _check(args) -> None:
    bad = [(0 <= args.idle_fraction < 1, "--idle-fraction", args.idle_fraction, "a fraction in [0, 1)"),
           (0 <= args.kill_fraction <= 1, "--kill-fraction", args.kill_fraction, "a fraction in [0, 1]"),
           (0 <= args.slow_fraction <= 1, "--slow-fraction", args.slow_fraction, "a fraction in [0, 1]"),
           (args.target_steps > args.warmup >= 0, "--warmup", args.warmup,
            f"0 .. --target-steps - 1 = {args.target_steps - 1}"),
           (args.window_median > 0, "--window-median", args.window_median, "> 0 seconds"),
           (args.window_sigma >= 0, "--window-sigma", args.window_sigma, ">= 0"),
           (args.slowdown >= 1, "--slowdown", args.slowdown, ">= 1"),
           (args.start_s >= 0, "--start-s", args.start_s, ">= 0 seconds"),
           (args.load_gbps > 0, "--load-gbps", args.load_gbps, "> 0"),
           (args.deadline is None or args.deadline > 0, "--deadline", args.deadline, "> 0 seconds"),
           (args.heartbeat is None or args.heartbeat > 0, "--heartbeat", args.heartbeat, "> 0 seconds")]
    for ok, flag, value, valid in bad:
        if not ok:
            raise ConfigError(f"{flag} {value}: valid: {valid}")


def _seeds(text: str) -> List[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise ConfigError(f"--seeds {text!r}: valid: seeds >= 0 separated by commas, e.g. 0,1,2")
    return seeds


def longest_lease_s(d, slots: int, prompt_tokens: int, longest: int) -> float:
    """How long an engine (decode model `d`), full, takes to decode a longest response at the longest
    context: about what a healthy lease may take."""
    return longest * (d.alpha + d.beta * slots + d.gamma * slots * (prompt_tokens + longest))


def worker_setup(args, cfg, p, k: int, mean_len: float, colocated: bool = False) -> Setup:
    """What a backfill window's workers cost and run, beside the placement `p` of the config `cfg`:
    one worker per GPU at rollout.tp 1 (as the runtime's workers), and the rules of the config's
    placement.elastic unless a flag overrides them."""
    import copy

    from verl_hpc.planning.hardware import INTER_NODE_GBPS
    from verl_hpc.planning.model_shape import model_arch, total_params

    one = copy.deepcopy(cfg)
    one.rollout.tp = 1
    w = placement_from_plan(one, mean_len, p.prompt_tokens, args.decode_mfu)
    per_node, e = cfg.slurm.gpus_per_node, cfg.placement.elastic
    node_bytes = per_node * total_params(model_arch(cfg.model.path)) * (2 if cfg.model.dtype != "float32" else 4)
    # the job and its engine, the checkpoint read to build the engine, the live weights from the first
    # training rank over its one link (a node's workers one after the other)
    startup = args.start_s + node_bytes / (args.load_gbps * 1e9) + node_bytes / (INTER_NODE_GBPS * 1e9)
    deadline, heartbeat = args.deadline or e.straggler_deadline_s, args.heartbeat or e.heartbeat_timeout_s
    if heartbeat >= deadline:  # the runtime's own rule (placement.elastic)
        raise ConfigError(f"--heartbeat {heartbeat:g}: valid: below the straggler deadline {deadline:g} s (a silent "
                          "worker is taken out before its work is re-dispatched)")
    return Setup(p, k, worker_engines=per_node, worker_gpus=per_node, worker_decode=w.decode, worker_slots=w.slots,
                 startup_s=startup, deadline_s=deadline, heartbeat_s=heartbeat,
                 keep_prefixes=args.continue_samples or e.lost_samples == "continue", slowdown=args.slowdown,
                 colocated=colocated)


def figures(out, setup: Setup, args, own_rollout_gpus: float) -> Dict:
    """One run's row: the figures the table and the JSON report."""
    U, rows = out.step_end, out.samples_per_step
    span = U[-1] - U[args.warmup]
    rollout_s = own_rollout_gpus * (U[-1] - (out.train_busy_s if setup.colocated else 0.0))
    return dict(samples_per_hour=(len(U) - 1 - args.warmup) * rows / span * 3600, hours_to_target=U[-1] / 3600,
                rollout_gpu_h_per_1k=(rollout_s + out.backfill_gpu_s) / 3600 / (rows * (len(U) - 1)) * 1000,
                backfill_gpu_h=out.backfill_gpu_s / 3600,
                backfill_generating_gpu_h=out.backfill_generating_gpu_s / 3600,
                joins=out.joins, leaves=out.leaves, redispatched=out.stats["redispatched"],
                duplicates=out.stats["duplicates"], handed_back=out.handed_back,
                generated_per_trained=out.generated_tokens / out.trained_tokens, max_staleness=max(out.staleness),
                mean_staleness=float(np.mean(out.staleness)), trained=rows * (len(U) - 1),
                accepted=out.accepted, completions=out.completions)


def _mean(rows: List[Dict]) -> Dict:
    keys = [k for k, v in rows[0].items() if isinstance(v, (int, float))]
    out = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    out["max_staleness"] = max(r["max_staleness"] for r in rows)
    return out


def _split(args, base, r: int, draws: Dict, model: BackfillModel, others: range, mean_len: float):
    """The split with `r` own rollout GPUs, without and with the pool, on every seed's draws."""

    cfg = split_config(base, r, args.k)
    p = placement_from_plan(cfg, mean_len, args.prompt_tokens, args.decode_mfu)
    setup = worker_setup(args, cfg, p, args.k, mean_len)
    fixed, elastic, first = [], [], None
    for seed, lengths in draws.items():
        alone = ElasticSim(setup, lengths, cfg.rollout.n, args.target_steps).run()
        until = 3 * alone.end_s  # windows opening later than this would come after any run's end
        windows = model.windows(others, seed, until)
        pooled = ElasticSim(setup, lengths, cfg.rollout.n, args.target_steps, windows).run()
        if pooled.end_s >= until:
            raise RuntimeError(f"seed {seed}: the run with the pool outlasted its drawn windows ({until:.0f} s)")
        fixed.append(figures(alone, setup, args, r))
        elastic.append(figures(pooled, setup, args, r))
        first = first or (alone, pooled, windows)
    return setup, fixed, elastic, first


def run_elastic(args) -> int:
    from verl_hpc.config.sections.placement import MAX_STALENESS

    _check(args)
    check_args(argparse.Namespace(**{**vars(args), "steps": args.target_steps}))  # simulate's own flags
    seeds = _seeds(args.seeds)
    if not 0 <= args.k <= MAX_STALENESS:
        raise ConfigError(f"--k {args.k}: valid: a staleness bound in [0, {MAX_STALENESS}]")
    base = base_config(args)
    per_node = base.slurm.gpus_per_node
    if args.cluster_nodes * per_node <= args.gpus:
        raise ConfigError(f"--cluster-nodes {args.cluster_nodes}: holds no node besides the run's --gpus {args.gpus} "
                          f"({per_node} GPUs a node); valid: > {args.gpus // per_node}")
    if args.prompt_tokens is None:
        args.prompt_tokens = base.data.max_prompt_length
    model = BackfillModel(args.window_median, args.window_sigma, args.idle_fraction, args.kill_fraction,
                          args.slow_fraction)
    others = range(args.cluster_nodes - args.gpus // per_node)
    rows = base.data.train_batch_size * base.rollout.n
    draws = {s: lognormal_lengths(args.target_steps, rows, args.len_median, args.len_sigma,
                                     base.data.max_response_length, s) for s in seeds}
    mean_len = float(np.mean([d.mean() for d in draws.values()]))

    colo_setup = worker_setup(args, base, placement_from_plan(base, mean_len, args.prompt_tokens, args.decode_mfu),
                              0, mean_len, colocated=True)
    colo_runs = [ElasticSim(colo_setup, d, base.rollout.n, args.target_steps).run() for d in draws.values()]
    colo = [figures(o, colo_setup, args, args.gpus) for o in colo_runs]
    splits, refused = {}, []
    for r in candidates(args, base):
        try:
            splits[r] = _split(args, base, r, draws, model, others, mean_len)
        except ConfigError as err:
            if args.rollout_gpus:
                raise ConfigError(f"--rollout-gpus {r}: {err}") from None
            refused.append(f"{r}: {err}")
    if not splits:
        raise ConfigError(f"no split of --gpus {args.gpus} is a valid layout: " + "; ".join(refused))
    best_fixed = max(splits, key=lambda r: _mean(splits[r][1])["samples_per_hour"])
    best = max(splits, key=lambda r: _mean(splits[r][2])["samples_per_hour"])
    setup = splits[best][0]
    out = dict(gpus=args.gpus, cluster_nodes=args.cluster_nodes, model=args.model, gpu_type=base.slurm.gpu_type,
               prompts=base.data.train_batch_size, n=base.rollout.n, k=args.k, target_steps=args.target_steps,
               warmup=args.warmup, seeds=seeds, mean_length=mean_len, max_tokens=base.data.max_response_length,
               backfill=dict(dataclasses.asdict(model), mean_window_s=model.mean_window_s,
                             busy_mean_s=model.busy_mean_s, other_nodes=len(others)),
               worker=dict(startup_s=setup.startup_s, deadline_s=setup.deadline_s, heartbeat_s=setup.heartbeat_s,
                           keep_prefixes=setup.keep_prefixes, slowdown=args.slowdown, engines=setup.worker_engines,
                           slots=setup.worker_slots,
                           longest_lease_s=longest_lease_s(setup.worker_decode, setup.worker_slots,
                                                           args.prompt_tokens, base.data.max_response_length),
                           own_longest_lease_s=longest_lease_s(setup.placement.decode, setup.placement.slots,
                                                               args.prompt_tokens, base.data.max_response_length)),
               placements=[dict(name="colocated", rollout_gpus=args.gpus, train_gpus=args.gpus, **_mean(colo)),
                           dict(name="fixed split", rollout_gpus=best_fixed, train_gpus=args.gpus - best_fixed,
                                **_mean(splits[best_fixed][1])),
                           dict(name="fixed split + elastic pool", rollout_gpus=best, train_gpus=args.gpus - best,
                                **_mean(splits[best][2]))],
               per_seed={"colocated": colo, "fixed split": splits[best_fixed][1],
                         "fixed split + elastic pool": splits[best][2]},
               splits={str(r): dict(fixed=_mean(f)["samples_per_hour"], elastic=_mean(e)["samples_per_hour"])
                       for r, (_, f, e, _) in splits.items()})
    print_elastic(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        curves = {"colocated": colo_runs[0],
                  f"fixed split {best_fixed}/{args.gpus - best_fixed}": splits[best_fixed][3][0],
                  f"fixed split + pool {best}/{args.gpus - best}": splits[best][3][1]}
        plot(args.plot, splits[best][3][1], splits[best][3][2], curves, best, out)
    return 0


def print_elastic(out: Dict) -> None:
    b, w = out["backfill"], out["worker"]
    print(f"simulated: {out['cluster_nodes']} nodes x {out['gpu_type']}, the run's own {out['gpus']} GPUs; "
          f"{out['model']}, {out['prompts']} prompts x {out['n']}, k = {out['k']}, {out['target_steps']} steps, "
          f"seeds {','.join(map(str, out['seeds']))}; mean response {out['mean_length']:.0f} tokens")
    print(f"backfill: {b['other_nodes']} other nodes, {b['idle_fraction']:.1%} idle, windows lognormal (median "
          f"{b['median_s']:.0f} s, sigma {b['sigma']:.2f}, mean {b['mean_window_s']:.0f} s), killed "
          f"{b['kill_fraction']:.0%}, slow {b['slow_fraction']:.0%} (x{w['slowdown']:g}); worker start-up "
          f"{w['startup_s']:.0f} s, {w['engines']} engines of {w['slots']} slots a node; deadline "
          f"{w['deadline_s']:.0f} s (a full engine decodes a longest response in {w['own_longest_lease_s']:.0f} s, "
          f"a worker's in {w['longest_lease_s']:.0f} s), heartbeat {w['heartbeat_s']:.0f} s; a leaver's samples "
          f"{'continued' if w['keep_prefixes'] else 'regenerated'}")
    print(f"{'placement':<27} {'rollout/train':>13} {'samples/h':>10} {'h to target':>11} "
          f"{'rollout GPU-h/1k':>16} {'backfill GPU-h (gen.)':>21} {'re-disp.':>8} {'handed back':>11} "
          f"{'dup.':>6} {'gen/trained':>11} {'stale max':>9}")
    for r in out["placements"]:
        held = r["backfill_gpu_h"]
        share = f" ({r['backfill_generating_gpu_h'] / held:.0%})" if held else ""
        print(f"{r['name']:<27} {str(r['rollout_gpus']) + '/' + str(r['train_gpus']):>13} "
              f"{r['samples_per_hour']:>10,.0f} {r['hours_to_target']:>11.2f} {r['rollout_gpu_h_per_1k']:>16.2f} "
              f"{f'{held:.1f}{share}':>21} {r['redispatched']:>8.0f} {r['handed_back']:>11.0f} "
              f"{r['duplicates']:>6.0f} {r['generated_per_trained']:>11.3f} {r['max_staleness']:>9.0f}")


def plot(path: str, outcome, windows, curves: Dict, rollout_gpus: int, out: Dict) -> None:
    """Top: the pool over time (first seed, the elastic placement): nodes offered, workers joined.
    Bottom: samples trained over time, each placement on the same draws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(o.end_s for o in curves.values())
    times = np.linspace(0, end, 4000)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    top.step(times / 3600, idle_nodes(windows, times), where="post", color="0.6",
             label="idle nodes offered (backfill windows)")
    sizes = [(0.0, 0)] + outcome.pool + [(outcome.end_s, outcome.pool[-1][1] if outcome.pool else 0)]
    top.step([t / 3600 for t, _ in sizes], [n for _, n in sizes], where="post", label="pool: workers generating")
    top.set_ylabel("nodes")
    top.legend(loc="upper right", fontsize=8)
    top.set_title(f"seed {out['seeds'][0]}: the run's {out['gpus']} GPUs ({rollout_gpus} rolling out) + backfill "
                  f"workers of {out['backfill']['other_nodes']} other nodes", fontsize=10)
    for name, o in curves.items():
        U = np.array(o.step_end)
        bottom.plot(U / 3600, np.arange(len(U)) * o.samples_per_step / 1000, label=name)
    bottom.set_xlabel("hours")
    bottom.set_ylabel("thousand samples trained")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_simulate_elastic(sub) -> None:

    p = sub.add_parser("simulate-elastic", help="simulated cluster: colocated, fixed split, split + backfill pool")
    p.add_argument("--config", default=str(ROOT / "configs" / "grpo_8b.yaml"), help="the job config (as simulate)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a dotted config override")
    p.add_argument("--model", default="qwen2.5-7b", help="model.path: a folder or a name the plan knows")
    p.add_argument("--gpus", type=int, default=64, help="the run's own GPUs (whole nodes)")
    p.add_argument("--cluster-nodes", type=int, default=64, help="nodes of the cluster, the run's own included")
    p.add_argument("--rollout-gpus", type=int, default=0, help="own GPUs that roll out in split (0: the best split)")
    p.add_argument("--k", type=int, default=2, help="the staleness bound k of the split placements")
    p.add_argument("--batch", type=int, default=None, help="data.train_batch_size (default: the config's)")
    p.add_argument("--n", type=int, default=None, help="rollout.n (default: the config's)")
    p.add_argument("--max-tokens", type=int, default=None, help="data.max_response_length (default: the config's)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="tokens per prompt (default: data.max_prompt_length)")
    p.add_argument("--len-median", type=float, default=1000.0, help="median response length (tokens)")
    p.add_argument("--len-sigma", type=float, default=1.0, help="lognormal sigma of response lengths")
    p.add_argument("--decode-mfu", type=float, default=None, help="the decode MFU behind beta (default: the plan's)")
    p.add_argument("--target-steps", type=int, default=200, help="RL steps to train (time to target)")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of samples/hour")
    p.add_argument("--seeds", default="0,1,2", help="draws of lengths and windows; the figures are their means")
    p.add_argument("--idle-fraction", type=float, default=IDLE_FRACTION, help="share of other nodes' time idle")
    p.add_argument("--window-median", type=float, default=WINDOW_MEDIAN_S, help="median backfill window (s)")
    p.add_argument("--window-sigma", type=float, default=WINDOW_SIGMA, help="lognormal sigma of window lengths")
    p.add_argument("--kill-fraction", type=float, default=0.1, help="windows whose worker dies without a goodbye")
    p.add_argument("--slow-fraction", type=float, default=0.05, help="windows whose worker decodes --slowdown x slower")
    p.add_argument("--slowdown", type=float, default=4.0, help="how much slower a slow worker decodes")
    p.add_argument("--start-s", type=float, default=90.0, help="a worker's job start + vLLM engine build (s)")
    p.add_argument("--load-gbps", type=float, default=5.0, help="a worker node's weight read bandwidth (GB/s)")
    p.add_argument("--deadline", type=float, default=None,
                   help="straggler deadline of a lease (s; default: placement.elastic.straggler_deadline_s)")
    p.add_argument("--heartbeat", type=float, default=None,
                   help="the pool's heartbeat timeout (s; default: placement.elastic.heartbeat_timeout_s)")
    p.add_argument("--continue", dest="continue_samples", action="store_true",
                   help="a leaver's samples continue from their prefixes (default: placement.elastic.lost_samples, "
                        "regenerate; continue is not built for the runtime's workers yet)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument("--plot", default=None, help="write the pool-over-time plot (PNG) to this file")
    p.set_defaults(func=run_elastic)
