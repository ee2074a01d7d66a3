"""A rollout engine that fails is rebuilt, not fatal: the faults of one generate (or weight load)
agreed by every rank, the engines rebuilt, the current weights synced into them, the unfinished
prompts generated again, within a bound.

    recovery = EngineRecovery(max_restarts=3, max_per_step=1, resync=weights.resync)
    rollout.recovery = recovery      # the engine asks it when a generate of any rank failed
    recovery.new_step(step)          # the per-step bound and stall count start again
    recovery.pop_metrics()           # rollout/engine_restarts, rollout/restart_seconds, rollout/rerun_prompts

What counts as an engine fault (`fault_of`): any exception from the engine's own work (vLLM raising
in a step, a kernel error, an out-of-memory, a stall its step counter caught), but not the
project's own errors (`VerlHpcError`: a prompt too long, a config the engine refuses), which are
the job's to report, on every rank together. Every rank learns every rank's fault from the
generate's own gather (rollout/replicas.py: no extra collective when nothing failed), so the
ranks decide alike: no rank acts alone.

The rebuild is collective: vLLM's engines of a multi-rank job build their groups over the job's
world, so every rank builds its engine again, not only the failed ones; a replica whose responses
were all finished keeps them, and only the failed replicas' prompts run again, with the same
per-request seeds (the same samples as without the fault, where the engine is deterministic).
After an out-of-memory the engine comes back smaller (rollout.max_num_seqs halved, said in the
log); the rebuilt engine holds the model folder's weights until `resync` (the trainer's full weight
sync, served-weights check on) gives it the current ones.

Bounds: `rollout.max_engine_restarts` in a job and `rollout.max_engine_restarts_per_step`; a stall
is retried once per step, a second one goes the stage watchdog's way (StageStalledError with the
stack). Past a bound: RestartsExhausted, one line naming the rank, the error and the count; the
trainer saves its last completed step first (trainer/programs/rl.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import Callable, Dict, List, Optional

from verl_hpc.errors import VerlHpcError

log = logging.getLogger(__name__)
KINDS = ("error", "oom", "stall", "fatal")


class EngineStalled(RuntimeError):
    """The engine kept stepping without producing a token for rollout.stall_timeout_s."""


class RolloutEngineError(VerlHpcError, RuntimeError):
    """A rollout engine failed and could not be brought back (no recovery here, or its bounds spent)."""

    exit_code, kind = 32, "rollout engine"


class RestartsExhausted(RolloutEngineError):
    """rollout.max_engine_restarts (per job or per step) spent."""

    exit_code, kind = 33, "engine restarts spent"


@dataclasses.dataclass(frozen=True)
class EngineFault:
    """One rank's failure in one call, as every rank learns it (picklable, small)."""
    rank: int
    replica: int
    stage: str  # generate | load | wake
    kind: str  # KINDS
    error: str  # "Type: first line"
    stack: str = ""

    def line(self) -> str:
        return f"rank {self.rank}: rollout engine failed in {self.stage} ({self.error})"


def fault_of(exc: BaseException, *, rank: int, replica: int, stage: str, agreed: bool = False) -> EngineFault:
    """The fault record of an exception raised by this rank's engine. `agreed`: the weight sync's
    SyncError, which every rank raises together and which quotes the engine's error: an engine
    fault, not the project's own."""
    import torch

    text = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    if isinstance(exc, VerlHpcError) and not agreed:
        kind = "fatal"
    elif isinstance(exc, EngineStalled):
        kind = "stall"
    elif isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        kind = "oom"
    else:
        kind = "error"
    return EngineFault(rank, replica, stage, kind, text, "".join(traceback.format_exception(exc))[-4000:])


def agreed_faults(mine: Optional[EngineFault]) -> List[EngineFault]:
    """Every rank's fault of a step that has no collective of its own to carry them (a wake): one
    all_gather of a small object; [] on every rank when none failed. A collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine] if mine is not None else []
    gathered: List[Optional[EngineFault]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [f for f in gathered if f is not None]


class EngineRecovery:
    def __init__(self, max_restarts: int, max_per_step: int, resync: Optional[Callable[[], dict]] = None):
        self.max_restarts, self.max_per_step, self.resync = int(max_restarts), int(max_per_step), resync
        self.total = 0  # restarts in this process's run
        self.step = 0
        self._step_restarts = 0
        self._stalls = 0
        self._metrics = {"restarts": 0.0, "seconds": 0.0, "rerun_prompts": 0.0}

    def new_step(self, step: int) -> None:
        self.step, self._step_restarts, self._stalls = step, 0, 0

    def recover(self, engine, faults: List[EngineFault], rerun_prompts: int = 0) -> None:
        """Every rank, together: check the bounds, rebuild this rank's engine (smaller after an
        out-of-memory), sync the current weights into it. Raises where the faults are not an
        engine's to recover from or a bound is spent."""
        first = faults[0]
        fatal = [f for f in faults if f.kind == "fatal"]
        if fatal:  # the project's own error on a rank: the job's to report, not the engine's to retry
            raise RolloutEngineError(fatal[0].line())
        stalls = [f for f in faults if f.kind == "stall"]
        if stalls:
            self._stalls += 1
            if self._stalls > 1:  # the second in a step: the watchdog's way, with where it stood
                from verl_hpc.runtime.watchdog import StageStalledError

                raise StageStalledError(f"rank {stalls[0].rank}: the rollout engine stalled twice in step "
                                        f"{self.step} ({stalls[0].error}); where it stood:\n{stalls[0].stack}")
        if self.total >= self.max_restarts or self._step_restarts >= self.max_per_step:
            spent = (f"{self.total} of rollout.max_engine_restarts = {self.max_restarts} in this job"
                     if self.total >= self.max_restarts else
                     f"{self._step_restarts} of rollout.max_engine_restarts_per_step = {self.max_per_step} "
                     f"in step {self.step}")
            raise RestartsExhausted(f"{first.line()}; restarts spent: {spent}")
        self.total += 1
        self._step_restarts += 1
        start = time.perf_counter()
        smaller = any(f.kind == "oom" for f in faults)
        for f in faults:
            log.warning("%s; rebuilding every rank's engine (restart %d of %d in this job)", f.line(),
                        self.total, self.max_restarts)
        what = engine.rebuild(smaller=smaller)
        if what:
            log.warning("rollout engine rebuilt after an out-of-memory: %s", what)
        if self.resync is not None:
            self.resync()
        seconds = time.perf_counter() - start
        log.info("rollout engine back in %.1f s; %d prompts to generate again", seconds, rerun_prompts)
        self._metrics["restarts"] += 1
        self._metrics["seconds"] += seconds
        self._metrics["rerun_prompts"] += rerun_prompts

    def pop_metrics(self) -> Dict[str, float]:
        """What recovery cost since the last call (the step's), and the job's restart count."""
        m, self._metrics = self._metrics, {"restarts": 0.0, "seconds": 0.0, "rerun_prompts": 0.0}
        return {"rollout/engine_restarts": m["restarts"], "rollout/restart_seconds": m["seconds"],
                "rollout/rerun_prompts": m["rerun_prompts"], "rollout/engine_restarts_total": float(self.total)}
