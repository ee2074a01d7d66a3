"""The harness of `python -m verl_hpc.gpu_check`: the state the checks share (`Kit`), a check's
description (`Check`), the NOT TESTABLE outcome, and the runner that orders the outcomes. The checks
themselves are in checks.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple


class NotTestable(Exception):  # a check outcome (NOT TESTABLE in the table), not a VerlHpcError
    """This check cannot run here; the message says what it would need."""


@dataclasses.dataclass
class Kit:
    out: Path
    rehearsal: bool = False
    ctx: Any = None
    model_path: Optional[str] = None
    engine: Any = None  # the trainable engine of the train/resume checks
    fsdp_engine: Any = None  # the FSDP engine, from its log-prob check to its step/export check
    peaks: Dict[str, int] = dataclasses.field(default_factory=dict)  # component -> bytes

    @property
    def dtype(self) -> str:
        return "float32" if self.rehearsal else "bfloat16"

    def measure(self, component: str, fn: Callable[[], Any]):
        """Run fn; record the GPU's max_memory_allocated over it (reported beside the table)."""
        from verl_hpc.runtime.device import peak_memory_allocated, reset_peak_memory

        reset_peak_memory()
        value = fn()
        peak = peak_memory_allocated()
        if peak is not None and not self.rehearsal:
            self.peaks[component] = peak
        return value


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    what: str
    run: Callable[[Kit], str]
    needs: Tuple[str, ...] = ()  # checks that must pass first
    machine: str = "1 GPU"  # what the machine must have (the dry run lists it)
    # seconds the check may take before it is stopped (TIMEOUT) and the next one runs; None: no
    # budget of its own, only the run's (--time-limit)
    budget_s: Optional[float] = None


class CheckTimeout(BaseException):
    """A check ran past its budget. A BaseException, so that no `except Exception` inside the check
    (or in vLLM under it) takes it for an error of its own and carries on."""


@contextlib.contextmanager
def time_limit(seconds: Optional[float]):
    """Raise CheckTimeout in this (main) thread after `seconds` of wall time; None: no limit. Python
    code is interrupted at once; a call that blocks in C (a kernel, a collective) when it returns:
    a hang there is ended by the run's own limit (make gpu-all restarts the checks left: all.py)."""
    if seconds is None:
        yield
        return

    def expired(signum, frame):  # noqa: ARG001 (signal handler signature)
        raise CheckTimeout(f"ran past its budget of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_checks(kit: Kit, checks: List[Check], only: Optional[List[str]] = None,
               log=print, on_row: Optional[Callable[[list], None]] = None,
               on_start: Optional[Callable[[Check, Optional[float]], None]] = None,
               deadline: Optional[float] = None) -> List[Tuple[Check, str, str, float]]:
    """[(check, status, detail, seconds)]; status PASS | FAIL | TIMEOUT | NOT TESTABLE | SKIPPED.
    `on_start(check, limit)` before each check runs, `on_row(rows)` after it (the table so far
    survives a run stopped at its time limit). Each check runs within its budget and what is left
    before `deadline` (time.monotonic()); past the deadline the rest are SKIPPED."""
    import traceback

    status: Dict[str, str] = {}
    rows = []
    for check in checks:
        if only is not None and check.name not in only:
            continue
        missing = [n for n in check.needs if status.get(n) != "PASS"]
        start = time.perf_counter()
        limit = check_limit(check, deadline)
        if missing:
            st, detail = "SKIPPED", f"needs {', '.join(missing)} to pass"
        elif limit is not None and limit <= 0:
            st, detail = "SKIPPED", "out of time: the run's time limit was spent"
        else:
            log(f"[gpu_check] {check.name}: {check.what} ..." + (f" (limit {limit:.0f} s)" if limit else ""))
            if on_start is not None:
                on_start(check, limit)
            try:
                with time_limit(limit):
                    st, detail = "PASS", check.run(kit)
            except CheckTimeout as e:
                st, detail = "TIMEOUT", f"stopped: {e}"
                (kit.out / f"{check.name}.traceback.txt").write_text(traceback.format_exc())
            except NotTestable as e:
                st, detail = "NOT TESTABLE", str(e)
            except Exception as e:  # a check failing must not hide the others
                st, detail = "FAIL", f"{type(e).__name__}: {e}"
                (kit.out / f"{check.name}.traceback.txt").write_text(traceback.format_exc())
        leftover = reset_between_checks(kit)
        if leftover and st not in ("FAIL", "TIMEOUT"):  # the check passed, but it would poison the next ones
            st, detail = "FAIL", leftover
        status[check.name] = st
        rows.append((check, st, detail, time.perf_counter() - start))
        if on_row is not None:
            on_row(rows)
    return rows


def check_limit(check: Check, deadline: Optional[float]) -> Optional[float]:
    """The seconds this check may run now: its budget, within what is left before the deadline."""
    left = None if deadline is None else deadline - time.monotonic()
    if check.budget_s is None:
        return left
    return check.budget_s if left is None else min(check.budget_s, left)


def reset_between_checks(kit: Kit) -> str:
    """Leave the process as the next check expects it, whatever this one did: no group left in
    torch's coalescing mode (a check that raised inside `_coalescing_manager` leaves its op list
    behind, and every later collective of that group is then queued and never run, so a later
    check could pass without its collectives having run), no engine of this check holding GPU
    memory. Returns why the state was dirty ("" when it was clean)."""
    import gc

    from verl_hpc.runtime.device import release_cached_memory

    why = ""
    try:
        from torch.distributed.distributed_c10d import _world

        pending = {g: ops for g, ops in _world.pg_coalesce_state.items() if ops}
        if pending:
            why = (f"left {sum(map(len, pending.values()))} collective(s) queued in a coalescing block "
                   f"on {len(pending)} group(s); cleared before the next check")
        _world.pg_coalesce_state.clear()
    except (ImportError, AttributeError):  # a torch without the coalescing state
        pass
    gc.collect()
    release_cached_memory()
    return why

