"""Preemption and time-limit signals become a flag the trainer polls between steps.

Slurm sends the warning signal (`--signal=USR2@120`, submitit's default too) before the time
limit and SIGTERM on preemption or cancel. Acting inside a handler would interrupt a collective
half-way on one rank, so the handlers only record; the trainer checks `PreemptionFlag.agreed()`
at a step boundary, where every rank is, and then checkpoints and asks to be requeued.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Iterable

import torch
import torch.distributed as dist

from verl_hpc.runtime.device import collective_device

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class PreemptionFlag:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None

    def is_set(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.time()
        # logging is not async-signal-safe in general, but CPython runs handlers between
        # bytecodes on the main thread, so a short message here is safe enough and very useful.
        log.warning("received %s: will checkpoint and requeue at the next step boundary",
                    signal.Signals(signum).name)

    def install(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> "PreemptionFlag":
        for sig in signals:
            signal.signal(sig, self._handle)
        return self

    def agreed(self, group=None) -> bool:
        """True on every rank if any rank saw a signal (a MAX all-reduce: one collective)."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.is_set()

        t = torch.tensor([1 if self.is_set() else 0], dtype=torch.int32, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())
