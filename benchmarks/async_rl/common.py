"""The helpers the simulator's commands share (simulate.py, elastic_cli.py, measure.py): the
repository root, a job config from the command line's flags and its split variant, the clock's
numbers from the memory/time plan (placement_from_plan), and the checks of the shared flags."""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import List, Optional

from .model import DecodeModel, Placement, TrainModel

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # verl_hpc from this checkout, whichever script imported us
    sys.path.insert(0, str(ROOT))

from verl_hpc.config import ConfigError, load_config, validate  # noqa: E402


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


def check_args(args) -> None:
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
