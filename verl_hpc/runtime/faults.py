"""The fault-injection hook for resilience tests: `VERL_HPC_FAULT=stage:rank:step:kind[,...]`.

Off unless the variable is set (a job's config cannot set it: `slurm.env` naming it is refused at
load, config/sections/cluster.py); a rank that finds it set says so in its log. Each fault fires once, where the trainer or
the rollout engine asks `maybe(stage)` with the step it is at:

    stage   generate | load | wake | update | step | save | judge   (where the code asks; `step`: at
            the start of the RL step, before the rollout; `save`: in the middle of a checkpoint save;
            `judge`: in a call of the generative judge's engine)
    rank    a global rank, or * for every rank
    step    the trainer's step number (1-based, as the logs count)
    kind    raise     a RuntimeError from the stage (an engine exception)
            oom       torch.OutOfMemoryError from the stage (an engine out of memory)
            stall     the rollout engine steps without producing a token (generate only)
            sigkill   the rank kills itself with SIGKILL (a node lost, an OOM killer)
            sigsegv   the rank kills itself with SIGSEGV (a crash in C)
            hang      the rank stops in its own code, outside any collective, for good

A fault fires once per job: once in a process, and only in the job's first launch (attempt 0:
`VERL_HPC_ATTEMPT`, which the in-allocation restarts count up, or torch's elastic restart count),
so a restart from a checkpoint that replays the step runs it healthy, as after a real fault.
Standard library only: a rank reads it before torch.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import List, Optional, Set

ENV = "VERL_HPC_FAULT"
ATTEMPT_ENV = "VERL_HPC_ATTEMPT"  # the in-allocation restart's count (launcher/restarts.py, the sbatch loop)
STAGES = ("generate", "load", "wake", "update", "step", "save", "judge")
KINDS = ("raise", "oom", "stall", "sigkill", "sigsegv", "hang")
ENGINE_KINDS = ("raise", "oom", "stall")  # what an engine stage can recover from in the process
log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The engine exception a `raise` fault stands for."""


@dataclasses.dataclass(frozen=True)
class Fault:
    stage: str
    rank: Optional[int]  # None: every rank
    step: int
    kind: str

    def __str__(self) -> str:
        return f"{self.stage}:{'*' if self.rank is None else self.rank}:{self.step}:{self.kind}"


def parse(text: str) -> List[Fault]:
    """The faults of a VERL_HPC_FAULT value; ValueError naming the entry and what is valid."""
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        parts = entry.split(":")
        valid = (f"stage:rank:step:kind, stage one of {', '.join(STAGES)}, rank a number or *, step a "
                 f"number >= 1, kind one of {', '.join(KINDS)}")
        if len(parts) != 4:
            raise ValueError(f"{ENV}: entry {entry!r}; valid: {valid}")
        stage, rank, step, kind = parts
        if stage not in STAGES or kind not in KINDS or not step.isdigit() or int(step) < 1 \
                or not (rank == "*" or rank.isdigit()):
            raise ValueError(f"{ENV}: entry {entry!r}; valid: {valid}")
        if kind == "stall" and stage != "generate":
            raise ValueError(f"{ENV}: entry {entry!r}: a stall is a rollout's; valid with stage generate")
        out.append(Fault(stage, None if rank == "*" else int(rank), int(step), kind))
    return out


def attempt() -> int:
    """This launch's number within the job: 0 the first, 1 after one in-allocation restart, ..."""
    for name in (ATTEMPT_ENV, "TORCHELASTIC_RESTART_COUNT"):
        raw = os.environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 0


class Injector:
    def __init__(self, faults: List[Fault], rank: int, first_launch: bool):
        self.faults, self.rank, self.armed = faults, rank, first_launch
        self.step = 0
        self._fired: Set[Fault] = set()

    def due(self, stage: str) -> Optional[Fault]:
        """The fault for `stage` at this rank and step that has not fired yet (marked fired now)."""
        if not self.armed:
            return None
        for f in self.faults:
            if f.stage == stage and f.step == self.step and f.rank in (None, self.rank) and f not in self._fired:
                self._fired.add(f)
                return f
        return None


_injector: Optional[Injector] = None


def install(rank: int, environ=os.environ) -> Optional[Injector]:
    """Read VERL_HPC_FAULT for this rank (at the rank's start; None where it is not set)."""
    global _injector
    text = environ.get(ENV, "").strip()
    _injector = Injector(parse(text), rank, attempt() == 0) if text else None
    if _injector is not None:
        log.warning("rank %d: test fault injection on (%s=%s)%s", rank, ENV, text,
                    "" if _injector.armed else f"; not armed in launch {attempt()} of this job")
    return _injector


def active() -> bool:
    """Whether this rank injects faults (VERL_HPC_FAULT set)."""
    return _injector is not None


def at_step(step: int) -> None:
    """The trainer's step now (before its rollout)."""
    if _injector is not None:
        _injector.step = step


def maybe(stage: str) -> Optional[str]:
    """Fire the fault due at `stage` now, if any: `raise` and `oom` raise here; the rank-ending
    kinds end or stop the process here; `stall` is returned for the engine to act out."""
    fault = _injector.due(stage) if _injector is not None else None
    if fault is None:
        return None
    log.warning("rank %d: injecting %s (%s)", _injector.rank, fault, ENV)
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault {fault}")
    if fault.kind == "oom":
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (injected fault {fault})")
    if fault.kind in ("sigkill", "sigsegv"):
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL if fault.kind == "sigkill" else signal.SIGSEGV)
        time.sleep(60)  # the signal is delivered before this returns
    if fault.kind == "hang":
        while True:  # outside any collective: the stage watchdog's (and the heartbeat's) case
            time.sleep(1)
    return fault.kind
