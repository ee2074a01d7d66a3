"""Asynchronous RL: colocated-synchronous against split-asynchronous placement.

    python benchmarks/bench_async.py simulate                       # 64 H100s, 7B, k = 0, 1, 2, 4
    python benchmarks/bench_async.py simulate --gpus 128 --rollout-gpus 64 --ks 1 --out sim.json
    python benchmarks/bench_async.py simulate --len-sigma 0          # every response the same length
    python benchmarks/bench_async.py simulate-elastic                # + backfill workers on a 64-node cluster
    python benchmarks/bench_async.py measure                         # real jobs on this machine's cores
    python benchmarks/bench_async.py measure --quick                 # the same, short

`simulate-elastic` adds an elastic pool of rollout workers in backfill windows to the same clock:
benchmarks/elastic_cli.py says what it reports, elastic_sim.py how, backfill.py the windows' source.

`measure` runs the same job colocated (1 rank x 2 threads; 2 ranks x 1 thread) and split (1 rollout
+ 1 training rank, k = 1) on the same cores: benchmarks/async_measure.py says what it reports.

`simulate` runs no model: a discrete-event simulation of RL steps on a simulated clock.
- Responses: lengths drawn per step from a lognormal (--len-median, --len-sigma, seeded) clipped
  at data.max_response_length; the same draws for every placement compared.
- Rollout: one vLLM engine per rollout.tp GPUs, continuous batching: an engine holds at most
  `slots` live sequences (the project's rollout.max_num_seqs, or fewer where the memory plan's KV
  cache cannot hold that many of mean length) and a waiting one takes the first free slot. One
  decode step of an engine with b live sequences holding C context tokens lasts
      alpha + beta * b + gamma * C
  alpha: reading the engine's weight shard once (bytes / the GPU's HBM bandwidth); gamma: reading
  one token's KV cache; beta: the plan's decode cost of one token (2 * parameters FLOPs at its
  decode MFU). As sequences finish the batch shrinks, and the longest ones decode nearly alone.
  Prefill is not counted.
- Training: seconds per token of the plan's forwards + updates + tensor-parallel traffic on the
  training GPUs, plus its per-step data-parallel traffic and offload copies; the weight sync is the
  plan's (verl_hpc/planning/suggest.py, step_time_parts).
- colocated-sync: all GPUs generate batch s, then train on it, then sync, in turn.
- split-async with staleness k: the rollout of batch s may start once the policy version (updates
  done) is >= s - 1 - k; the trainer trains batch s once it is generated and update s - 1 is done;
  each update is followed by the weight sync, during which the rollout GPUs stop generating (they
  load the weights; sequences in flight then continue with the new ones). k = 0 is on-policy.
Reported per k, for the best split of the GPUs (or --rollout-gpus): speedup over colocated-sync in
the same run, the idle fraction of each group (time waiting on the other), and the staleness of
each batch's oldest token, over the steps after --warmup. --out writes the same as JSON.
"""
from __future__ import annotations

import argparse
import bisect
import copy
import dataclasses
import heapq
import json
import math
import sys
from collections import deque
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from async_measure import add_measure  # noqa: E402
from elastic_cli import add_simulate_elastic  # noqa: E402
from verl_hpc.config import ConfigError, load_config, validate  # noqa: E402
from verl_hpc.errors import VerlHpcError  # noqa: E402


# ----------------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """Seconds of one decode step of one engine: alpha + beta * live + gamma * live context tokens."""

    alpha: float
    beta: float
    gamma: float


@dataclasses.dataclass(frozen=True)
class TrainModel:
    """Seconds of one training step: per_token * tokens in the batch + per_step."""

    per_token: float
    per_step: float

    def seconds(self, tokens: float) -> float:
        return self.per_token * tokens + self.per_step


@dataclasses.dataclass(frozen=True)
class Placement:
    """What the clock needs of one placement: the rollout engines and the trainer."""

    engines: int
    slots: int  # live sequences per engine at most
    decode: DecodeModel
    train: TrainModel
    sync_s: float  # one weight sync, trainer -> engines
    prompt_tokens: int


@dataclasses.dataclass
class Result:
    step_s: float  # seconds per step in the window
    rollout_idle: float  # share of the rollout GPUs' time spent waiting for new weights
    train_idle: float  # share of the trainer's time spent waiting for a batch
    staleness: List[int]  # per batch in the window: trainer version - version of its oldest token

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.step_s

    @property
    def mean_staleness(self) -> float:
        return float(np.mean(self.staleness))


def lognormal_lengths(steps: int, rows: int, median: float, sigma: float, max_tokens: int,
                      seed: int) -> np.ndarray:
    """[steps, rows] response lengths: lognormal around `median` (sigma 0: all equal), clipped to
    [1, max_tokens]."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(math.log(median), sigma, size=(steps, rows)) if sigma > 0 else \
        np.full((steps, rows), float(median))
    return np.clip(np.rint(draws), 1, max_tokens).astype(np.int64)


class Clock:
    """The schedule the trainer makes and the engines obey: U[v] is when policy version v reaches
    the engines (U[0] = 0), pauses[v - 1] = (T_v, U_v) the sync after update v."""

    def __init__(self, staleness: int):
        self.k = staleness
        self.U: List[float] = [0.0]
        self.pauses: List[tuple] = []

    def admission(self, batch: int) -> Optional[float]:
        """When batch `batch` (1-based) may start, or None while the version it waits for is not done."""
        v = max(0, batch - 1 - self.k)
        return self.U[v] if v < len(self.U) else None

    def version_at(self, t: float) -> int:
        return bisect.bisect_right(self.U, t) - 1


class Engine:
    """One vLLM engine: continuous batching on a fluid decode-step counter `tau`."""

    def __init__(self, p: Placement, batches: List[np.ndarray]):
        self.p, self.batches = p, batches  # batches[s - 1]: this engine's lengths of batch s
        self.t = self.tau = 0.0
        self.live: List[tuple] = []  # heap of (finish tau, start tau, batch)
        self.start_sum = 0.0  # sum of the live sequences' start taus
        self.waiting: deque = deque()  # (length, batch)
        self.next_batch = 1  # the first batch not yet admitted
        self.pause_i = 0  # the first pause that may still lie ahead
        self.left = [len(b) for b in batches]
        self.done_at = [0.0] * len(batches)
        self.first_version: Dict[int, int] = {}
        self.idle: List[tuple] = []  # (from, to): nothing to generate, waiting for new weights

    # one decode step at tau lasts a + g * tau (the live set fixed)
    def _rates(self):
        b, d = len(self.live), self.p.decode
        return d.alpha + d.beta * b + d.gamma * (b * self.p.prompt_tokens - self.start_sum), d.gamma * b

    def _seconds(self, steps: float) -> float:
        a, g = self._rates()
        return steps * (a + g * self.tau) + g * steps * steps / 2

    def _steps(self, seconds: float) -> float:
        a, g = self._rates()
        b = a + g * self.tau
        return 2 * seconds / (b + math.sqrt(b * b + 2 * g * seconds))  # the root of _seconds, stably

    def _admit(self, clock: Clock) -> None:
        while self.next_batch <= len(self.batches):
            at = clock.admission(self.next_batch)
            if at is None or at > self.t:
                return
            self.waiting.extend((int(n), self.next_batch) for n in self.batches[self.next_batch - 1])
            self.next_batch += 1

    def _fill(self, clock: Clock) -> None:
        while self.waiting and len(self.live) < self.p.slots:
            n, batch = self.waiting.popleft()
            heapq.heappush(self.live, (self.tau + n, self.tau, batch))
            self.start_sum += self.tau
            self.first_version.setdefault(batch, clock.version_at(self.t))

    def _next_event(self, clock: Clock) -> tuple:
        """(time, kind) of the next thing the trainer does to this engine: a pause or an admission."""
        pauses = clock.pauses
        while self.pause_i < len(pauses) and pauses[self.pause_i][1] <= self.t:
            self.pause_i += 1
        pause = pauses[self.pause_i][0] if self.pause_i < len(pauses) else math.inf
        admit = clock.admission(self.next_batch) if self.next_batch <= len(self.batches) else None
        admit = math.inf if admit is None else admit
        return (pause, "pause") if pause <= admit else (admit, "admit")

    def _advance(self, to: float) -> None:
        """Decode until time `to`, cut short by the trainer (a fraction of a step: fluid)."""
        self.tau += self._steps(to - self.t)
        self.t = to

    def _finish_first(self) -> None:
        finish = self.live[0][0]
        self.t += self._seconds(finish - self.tau)
        self.tau = finish
        while self.live and self.live[0][0] <= self.tau + 1e-9:
            _, start, batch = heapq.heappop(self.live)
            self.start_sum -= start
            self.left[batch - 1] -= 1
            if self.left[batch - 1] == 0:
                self.done_at[batch - 1] = self.t

    def run_until_done(self, batch: int, clock: Clock) -> None:
        """Generate until this engine's share of `batch` is complete (the trainer waits for it)."""
        self._run(clock, lambda: self.left[batch - 1] == 0)

    def run_until(self, until: float, clock: Clock) -> None:
        """Generate (or wait) until time `until`: the end of the measured window."""
        self._run(clock, lambda: self.t >= until, until)

    def _run(self, clock: Clock, stop, until: float = math.inf) -> None:
        while not stop():
            self._admit(clock)
            self._fill(clock)
            at, kind = self._next_event(clock)
            if kind == "pause" and at <= self.t:  # inside a weight sync: no decoding
                self.t = clock.pauses[self.pause_i][1]
                continue
            at = min(at, until)
            if not self.live:
                assert at < math.inf, "nothing to generate and nothing to wait for"
                self.idle.append((self.t, at))
                self.t = at
            elif self.t + self._seconds(self.live[0][0] - self.tau) <= at:
                self._finish_first()
            else:
                self._advance(at)


def split_rows(lengths: np.ndarray, n: int, engines: int) -> List[List[np.ndarray]]:
    """Per engine, per step: the lengths of its prompts' n samples (prompts dealt in contiguous
    chunks, as the rollout ranks split a batch)."""
    steps, rows = lengths.shape
    chunks = np.array_split(np.arange(rows // n), engines)
    return [[lengths[s].reshape(-1, n)[c].ravel() for s in range(steps)] for c in chunks]


def _overlap(intervals, lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def simulate(p: Placement, lengths: np.ndarray, n: int, staleness: int, warmup: int,
             steps: Optional[int] = None, overlapped: bool = True) -> Result:
    """`steps` RL steps on the clock; lengths: [batches, prompts x n]. The rollout may run k + 1
    batches ahead of the trainer, so `steps` defaults to the batches less k + 1 (all of them when
    not `overlapped`: colocated, the same GPUs roll out and train in turn, the next rollout waits
    for the sync, and the groups' idle fractions are not defined: nan)."""
    k = staleness if overlapped else 0
    steps = steps or lengths.shape[0] - (k + 1 if overlapped else 0)
    assert 0 <= warmup < steps and steps + (k + 1 if overlapped else 0) <= lengths.shape[0]
    clock = Clock(k)
    engines = [Engine(p, rows) for rows in split_rows(lengths, n, p.engines)]
    waits = []
    for s in range(1, steps + 1):
        for e in engines:
            e.run_until_done(s, clock)
        ready = max(e.done_at[s - 1] for e in engines)
        start = max(ready, clock.U[-1])
        waits.append((clock.U[-1], start))
        tokens = float(lengths[s - 1].sum() + lengths.shape[1] * p.prompt_tokens)
        trained = start + p.train.seconds(tokens)
        clock.pauses.append((trained, trained + p.sync_s))
        clock.U.append(trained + p.sync_s)
    lo, hi = clock.U[warmup], clock.U[steps]
    stale = [s - 1 - min(e.first_version[s] for e in engines if s in e.first_version)
             for s in range(warmup + 1, steps + 1)]
    if not overlapped:
        return Result((hi - lo) / (steps - warmup), math.nan, math.nan, stale)
    for e in engines:  # the rollout keeps generating the batches ahead while the last step trains
        e.run_until(hi, clock)
    rollout_idle = sum(_overlap(e.idle, lo, hi) for e in engines) / (len(engines) * (hi - lo))
    return Result((hi - lo) / (steps - warmup), rollout_idle, _overlap(waits, lo, hi) / (hi - lo), stale)


# ------------------------------------------------------------------------ numbers from the plan
def _gpu(cfg):
    from verl_hpc.planning import hardware

    gpu = hardware.gpu_type(cfg.slurm.gpu_type)
    if gpu is None or not gpu.hbm_tbps:
        raise ConfigError(f"slurm.gpu_type = {cfg.slurm.gpu_type!r}: simulate needs a GPU of the table "
                          f"with a memory bandwidth ({', '.join(hardware.GPUS)})")
    return gpu


def placement_from_plan(cfg, mean_length: float, prompt_tokens: int,
                        decode_mfu: Optional[float] = None) -> Placement:
    """The rollout engines and trainer of `cfg` (colocated, or split: each group on its own GPUs)
    from the memory/time plan. Which number comes from where: see `describe`. decode_mfu: instead
    of the plan's assumed decode MFU (a sensitivity check)."""
    from verl_hpc.planning import hardware
    from verl_hpc.planning.model_shape import model_arch, total_params
    from verl_hpc.planning.phases import gpu_total_bytes
    from verl_hpc.planning.rollout import kv_bytes_per_token, rollout_bytes
    from verl_hpc.planning.suggest import step_time_parts

    gpu, arch = _gpu(cfg), model_arch(cfg.model.path)
    e = 2 if cfg.model.dtype != "float32" else 4
    tp, params = cfg.rollout.tp, total_params(arch)
    hbm = gpu.hbm_tbps * 1e12
    decode = DecodeModel(alpha=params * e / tp / hbm,
                         beta=2 * params / (tp * gpu.bf16_tflops * 1e12 * (decode_mfu or hardware.ASSUMED_DECODE_MFU)),
                         gamma=kv_bytes_per_token(arch, e) / tp / hbm)
    kv = rollout_bytes(arch, cfg, gpu_total=gpu_total_bytes(cfg, None), param_bytes=e).kv_cache * tp
    fits = int(kv // (kv_bytes_per_token(arch, e) * (prompt_tokens + mean_length)))
    slots = max(1, min(cfg.rollout.max_num_seqs(cfg), fits))
    parts = step_time_parts(cfg, gpu)
    plan_tokens = cfg.data.train_batch_size * cfg.rollout.n * (cfg.data.max_prompt_length
                                                              + cfg.data.max_response_length)
    train = TrainModel((parts["forwards"] + parts["updates"] + parts["tp_comms"]) / plan_tokens,
                       parts["dp_comms"] + parts["offload"])
    return Placement(cfg.rollout_world_size // tp, slots, decode, train, parts["weight_sync"],
                     prompt_tokens)


OFFLOADS = ("actor.param_offload", "actor.grad_offload", "actor.optimizer_offload",
            "critic.param_offload", "critic.grad_offload", "critic.optimizer_offload", "ref.param_offload")


def base_config(args):
    """The colocated job: the config file, --set and the flags, on --gpus GPUs."""
    over = [f"model.path={args.model}", *args.set]
    over += [f"{k}={v}" for k, v in (("data.train_batch_size", args.batch), ("rollout.n", args.n),
                                     ("data.max_response_length", args.max_tokens)) if v is not None]
    cfg = load_config(args.config, over)
    per_node = cfg.slurm.gpus_per_node
    if per_node <= 0 or args.gpus % per_node:
        raise ConfigError(f"--gpus {args.gpus}: not a multiple of slurm.gpus_per_node = {per_node} "
                          f"({args.config}); valid: whole GPU nodes")
    cfg.slurm.nodes = args.gpus // per_node
    validate(cfg, check_model=False)
    return cfg


def split_config(base, rollout_gpus: int, staleness: int):
    """The same job split: the first `rollout_gpus` ranks roll out; the training ranks keep their
    roles resident (no vLLM on them to make room for)."""
    cfg = copy.deepcopy(base)
    cfg.placement.mode, cfg.placement.rollout_ranks = "split", rollout_gpus
    cfg.async_training.staleness = staleness
    for key in OFFLOADS:
        role, field = key.split(".")
        setattr(getattr(cfg, role), field, False)
    validate(cfg, check_model=False)
    return cfg


def describe(cfg, p: Placement) -> str:
    d = p.decode
    return (f"{cfg.model.path} on {cfg.slurm.gpu_type}: decode step = {d.alpha * 1e3:.2f} ms (weights / HBM) "
            f"+ {d.beta * 1e3:.3f} ms x live sequences (plan's decode MFU) + {d.gamma * 1e9:.2f} ns x live "
            f"context tokens (KV / HBM); {p.slots} slots per engine (rollout.max_num_seqs, the plan's KV "
            f"cache); training {p.train.per_token * 1e6:.1f} us/token on {cfg.train_world_size} GPUs + "
            f"{p.train.per_step:.2f} s/step (plan); weight sync {p.sync_s:.2f} s (plan)")


# ----------------------------------------------------------------------------------- simulate
def _check_args(args) -> None:
    bad = [(args.gpus > 0, "--gpus", args.gpus, "> 0"),
           (args.rollout_gpus >= 0, "--rollout-gpus", args.rollout_gpus, ">= 0 (0: search)"),
           (args.len_median > 0, "--len-median", args.len_median, "> 0"),
           (args.len_sigma >= 0, "--len-sigma", args.len_sigma, ">= 0"),
           (args.decode_mfu is None or 0 < args.decode_mfu <= 1, "--decode-mfu", args.decode_mfu, "(0, 1]"),
           (args.prompt_tokens is None or args.prompt_tokens >= 0, "--prompt-tokens", args.prompt_tokens,
            ">= 0"),
           (0 <= args.warmup < args.steps, "--warmup", args.warmup, f"0 .. --steps - 1 = {args.steps - 1}")]
    for ok, flag, value, valid in bad:
        if not ok:
            raise ConfigError(f"{flag} {value}: valid: {valid}")


def _ks(text: str) -> List[int]:
    from verl_hpc.config.sections.placement import MAX_STALENESS

    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or not all(0 <= k <= MAX_STALENESS for k in ks):
        raise ConfigError(f"--ks {text!r}: valid: staleness bounds in [0, {MAX_STALENESS}] separated by "
                          "commas, e.g. 0,1,2,4")
    return ks


def candidates(args, cfg) -> List[int]:
    """Rollout GPU counts to try: --rollout-gpus, or every whole number of nodes (every multiple of
    rollout.tp on a single node) that leaves training GPUs."""
    if args.rollout_gpus:
        if args.rollout_gpus >= args.gpus:
            raise ConfigError(f"--rollout-gpus {args.rollout_gpus}: leaves no training GPU of --gpus "
                              f"{args.gpus}; valid: 1 .. {args.gpus - 1}")
        return [args.rollout_gpus]
    step = cfg.slurm.gpus_per_node if args.gpus >= 2 * cfg.slurm.gpus_per_node else cfg.rollout.tp
    return list(range(step, args.gpus, step))


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
    _check_args(args)
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    add_simulate(sub)
    add_simulate_elastic(sub)  # the same clock with backfill workers joining and leaving
    add_measure(sub)  # the same task, model and settings run colocated-sync and split-async on this machine
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # measure writes the command line into its results
    try:
        return args.func(args)
    except VerlHpcError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
