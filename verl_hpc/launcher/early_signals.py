"""A program's SIGTERM, Ctrl-C and SIGUSR2 before its own handling exists: one line, the stop's exit code.

`python -m verl_hpc.submit` spends its first seconds importing torch and friends and checking the
config's files, before it starts or submits anything (10-25 s on a loaded login node); a SIGTERM
there ended it without a word and a Ctrl-C with a KeyboardInterrupt traceback. So each command-line
entry calls one of these first, before its other imports (stdlib only here, for that reason):

    early_signals.install("submit", "before any rank started; nothing was submitted")
    early_signals.where("while waiting; job 42 goes on (scancel 42 stops it)")   # from here on
    with early_signals.held(): ...       # a signal waits for the block's end (a submission)
    early_signals.keep()                 # a rank (verl_hpc.job): kept for its PreemptionFlag

install: a signal prints `[submit] stopped by SIGTERM before any rank started; nothing was
submitted` on stderr and exits with 128 + its number, 143 for SIGTERM, 130 for Ctrl-C and 140 for
SIGUSR2 (Slurm's warning signal, which would otherwise end the program silently): the codes of a
stopped local job (docs/signals.md). It exits with os._exit: an exception raised from the
handler lands wherever the main thread is (inside an import, under some library's `except
BaseException`), where it can be swallowed or printed as a traceback, and nothing has been started
yet that would need cleaning up. Where the program starts things it hands the signals on (the
local launcher's LocalStop) or holds them (`held`).

keep: a rank does not end at a signal in its start-up. Its launcher signals every rank at once and
the others may already be past theirs, in a collective with it: the signal is kept until
runtime.bootstrap has installed the rank's PreemptionFlag, which takes it over (`hand_over`), so
it means what it means later: checkpoint at the next step boundary, then stop. A second Ctrl-C
raises KeyboardInterrupt, as the flag's does.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Callable, Iterator, List, Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
# what a rank keeps: runtime/signals.py's DEFAULT_SIGNALS (the warning signal, SIGTERM, SIGINT),
# not imported from there because importing verl_hpc.runtime imports torch (a test keeps them equal)
RANK_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)

_program: Optional[str] = None  # install()'s: None where no entry point installed us (in-process use)
_where = ""
_kept: List[int] = []


def install(program: str, where: str) -> None:
    """From now on a signal ends this program with `[program] stopped by NAME where` and 128 + n."""
    global _program
    _program = program
    where_now(where)
    for s in SIGNALS:
        signal.signal(s, _stop)


def where_now(text: str) -> None:
    """How the line ends from now on: what was done, what goes on without us."""
    global _where
    _where = text


def _stop(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    try:  # what the program printed so far comes first (os._exit flushes nothing)
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a flush interrupted mid-write by this very signal
        pass
    os.write(2, f"[{_program}] stopped by {signal.Signals(signum).name} {_where}\n".encode())
    os._exit(128 + int(signum))


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A signal inside the block ends the program only at its end, with the line `where_now` says
    then: a submission cut half-way would leave the user not knowing whether a job exists."""
    if _program is None:  # not installed: in-process use keeps its own handlers
        yield
        return
    came: List[int] = []
    for s in SIGNALS:
        signal.signal(s, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for s in SIGNALS:
            signal.signal(s, _stop)
        if came:
            _stop(came[0], None)


def keep() -> None:
    """A rank: from now on signals are kept for its PreemptionFlag (`hand_over`)."""
    for s in RANK_SIGNALS:
        signal.signal(s, _keep)


def _keep(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    if signum == signal.SIGINT and signal.SIGINT in _kept:  # Ctrl-C twice: the user will not wait
        raise KeyboardInterrupt
    _kept.append(int(signum))


def hand_over(record: Callable[[int], None]) -> None:
    """Give each signal kept so far, in order, to `record` (PreemptionFlag.record), once."""
    while _kept:
        record(_kept.pop(0))
