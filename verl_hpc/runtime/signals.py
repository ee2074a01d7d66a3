"""Slurm's signals become a flag the trainer polls between steps.

Two signals, two meanings (the rule Slurm users expect; docs/signals.md):
- the warning signal (`--signal=USR2@<slurm.signal_delay_s>`, submitit's default too) comes before
  the time limit: checkpoint and requeue;
- SIGTERM comes on `scancel`, at the time limit, or when Slurm preempts the job: checkpoint if
  there is time, then exit. It requeues only when Slurm itself is preempting the job, which
  runtime/requeue.py asks Slurm about (`scontrol show job`) before requeueing anything.
SIGINT (Ctrl-C, or the local launcher passing on the submitter's) means what SIGTERM means: stop
with a checkpoint. A save in progress is never cut short by it; a second SIGINT raises the usual
KeyboardInterrupt, abandoning the step at once (`latest` still names a complete checkpoint).

Acting inside a handler would interrupt a collective half-way on one rank, so the handlers only
record; the trainer checks `PreemptionFlag.agreed()` at a step boundary, where every rank is.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Iterable, Optional

log = logging.getLogger(__name__)

WARNING_SIGNAL = signal.SIGUSR2  # what submitit's signal_delay_s (--signal=USR2@N) sends
DEFAULT_SIGNALS = (WARNING_SIGNAL, signal.SIGTERM, signal.SIGINT)
# agreed() all-reduces one code per rank with MAX: the warning signal wins over SIGTERM (a job
# told both is ending at its time limit and wants its requeue). SIGINT is a stop, as SIGTERM.
_CODES = {None: 0, "SIGTERM": 1, WARNING_SIGNAL.name: 2}
_NAMES = {0: None, 1: "SIGTERM", 2: WARNING_SIGNAL.name}


class PreemptionFlag:
    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self.received_at: Optional[float] = None
        self.agreed_signal: Optional[str] = None  # after agreed(): the signal every rank acts on

    def is_set(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        if signum == signal.SIGINT and self.signal_name == "SIGINT":  # Ctrl-C twice: the user will not wait
            raise KeyboardInterrupt
        self.record(signum)

    def record(self, signum: int) -> None:
        """Note a signal: the handler's work, and that of a signal a rank kept from before this flag
        existed (verl_hpc/launcher/early_signals.py; job.run hands it over)."""
        name = signal.Signals(signum).name
        if self.signal_name is None or _CODES.get(name, 1) > _CODES.get(self.signal_name, 1):
            self.signal_name = name
            self.received_at = time.time()
        # logging is not async-signal-safe in general, but CPython runs handlers between
        # bytecodes on the main thread, so a short message here is safe enough and very useful.
        if name == WARNING_SIGNAL.name:
            log.warning("received %s: will checkpoint and requeue at the next step boundary", name)
        elif name == "SIGINT":
            log.warning("received SIGINT: will checkpoint at the next step boundary, then stop (a second "
                        "SIGINT abandons the step in flight)")
        else:
            log.warning("received %s: will checkpoint at the next step boundary if there is time, then "
                        "stop (requeued only if Slurm is preempting the job)", name)

    def install(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> "PreemptionFlag":
        for sig in signals:
            signal.signal(sig, self._handle)
        return self

    def agreed(self, group=None) -> bool:
        """True on every rank if any rank saw a signal (a MAX all-reduce: one collective); sets
        `agreed_signal` to the strongest signal any rank saw (the warning signal over SIGTERM)."""
        import torch
        import torch.distributed as dist

        code = _CODES.get(self.signal_name, 1)
        if dist.is_available() and dist.is_initialized():
            from verl_hpc.runtime.device import collective_device

            t = torch.tensor([code], dtype=torch.int32, device=collective_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            code = int(t.item())
        # this rank's own signal when it is the one agreed on (SIGINT is named as itself)
        mine = self.signal_name if _CODES.get(self.signal_name, 1) == code else None
        self.agreed_signal = mine or _NAMES[code]
        return code > 0
