"""The `safety:` switches at run time: the rank-0 banner, torch.profiler traces for chosen steps,
and debug mode (autograd anomaly detection, cross-rank consistency checks every step).

    log_banner(cfg, ctx)                         # verl_hpc/job.py, for every program
    switches = SafetySwitches(cfg, ctx)          # every rank (the RL program)
    with switches.step(step):                   # traced when safety.profiling and step is listed
        metrics = trainer.step(step, timer)
    switches.check_ranks_agree(step, metrics)   # safety.debug: every rank must hold the same figures

Cross-rank checks: every rank runs the same step on the same global batch (rank 0 samples the
prompts and broadcasts them), so the step number, the config and the batch-level figures
(sample/token counts, rewards, rollout lengths) must be identical everywhere. A rank that drifted
(started from another config, missed a broadcast, resumed from another step) is caught at the
step it happened, with the first figure that differs, instead of surfacing as a hang or a quietly
wrong run hours later.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import Dict, Iterator

import torch

from verl_hpc.errors import VerlHpcError

log = logging.getLogger(__name__)

# batch-level figures every rank computes from the same global batch
AGREED_PREFIXES = ("train/samples", "train/tokens", "reward/", "rollout/sequences", "rollout/response_tokens")
PROFILE_DIR = "profiles"


class RankDisagreement(VerlHpcError, RuntimeError):
    """safety.debug: ranks that must hold the same values after a step do not."""

    exit_code, kind = 20, "rank disagreement"


def banner(cfg) -> str:
    """The lines rank 0 prints when any switch is on ('' when none is)."""
    s = cfg.safety
    on = s.switched_on
    if not on:
        return ""
    what = {"allow_custom_code": "user code runs in every rank (reward.custom_function / model.trust_remote_code)",
            "profiling": f"torch.profiler traces for steps {list(s.profile_steps)} -> "
                         f"{Path(cfg.trainer.output_dir) / PROFILE_DIR}",
            "debug": "autograd anomaly detection + cross-rank checks every step (slow)"}
    rule = "!" * 78
    body = "\n".join(f"!! safety.{name} = true: {what[name]}" for name in on)
    return f"\n{rule}\n!! SAFETY SWITCHES ON (not for production runs)\n{body}\n{rule}"


def log_banner(cfg, ctx) -> None:
    text = banner(cfg)
    if text and ctx.rank == 0:
        log.warning(text)


class SafetySwitches:
    def __init__(self, cfg, ctx) -> None:
        self.cfg, self.ctx = cfg, ctx
        s = cfg.safety
        self.profile_steps = set(s.profile_steps) if s.profiling else set()
        self.debug = bool(s.debug)
        self.profile_dir = Path(cfg.trainer.output_dir) / PROFILE_DIR
        self.traces: list[Path] = []
        if self.debug:
            torch.autograd.set_detect_anomaly(True)  # names the forward op behind a NaN gradient
        from verl_hpc.config import to_yaml

        self._config_digest = hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.profile_steps:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        from verl_hpc.runtime.device import has_gpu

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if has_gpu() else [])
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        path = self.profile_dir / f"step_{step:06d}_rank_{self.ctx.rank:05d}.json"
        with profile(activities=activities, record_shapes=True) as prof:
            yield
        prof.export_chrome_trace(str(path))  # open in chrome://tracing or https://ui.perfetto.dev
        self.traces.append(path)
        log.info("safety.profiling: step %d trace of rank %d -> %s", step, self.ctx.rank, path)

    def fingerprint(self, step: int, metrics: Dict[str, float]) -> dict:
        agreed = {k: repr(float(v)) for k, v in sorted(metrics.items())
                  if k.startswith(AGREED_PREFIXES) and isinstance(v, (int, float))}
        return {"step": int(step), "config": self._config_digest, "figures": agreed}

    def check_ranks_agree(self, step: int, metrics: Dict[str, float]) -> None:
        """safety.debug: all-gather every rank's fingerprint; raise on the first difference."""
        if not self.debug:
            return
        import torch.distributed as dist

        mine = self.fingerprint(step, metrics)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        problem = first_difference(everyone)
        if problem:
            raise RankDisagreement(f"safety.debug: ranks disagree after step {step}: {problem}")


def first_difference(fingerprints: list) -> str:
    """'' when every rank's fingerprint equals rank 0's; else what differs first, and where."""
    ref = fingerprints[0]
    for rank, fp in enumerate(fingerprints[1:], start=1):
        for key in ("step", "config"):
            if fp[key] != ref[key]:
                return f"{key} is {fp[key]!r} on rank {rank} but {ref[key]!r} on rank 0"
        for name in sorted(set(ref["figures"]) | set(fp["figures"])):
            a, b = ref["figures"].get(name), fp["figures"].get(name)
            if a != b:
                return f"{name} is {b} on rank {rank} but {a} on rank 0"
    return ""
