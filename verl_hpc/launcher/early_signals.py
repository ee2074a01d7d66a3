"""A program's SIGTERM, Ctrl-C and SIGUSR2 before its own handling exists: one line, the stop's exit code.

`python -m verl_hpc.submit` spends its first seconds importing torch and friends and checking the
config's files, before it starts or submits anything (10-25 s on a loaded login node); a SIGTERM
there ended it without a word and a Ctrl-C with a KeyboardInterrupt traceback. So each command-line
entry calls one of these first, before its other imports (stdlib only here, for that reason):

    early_signals.install("submit", "before any rank started; nothing was submitted")
    early_signals.where("while waiting; job 42 goes on (scancel 42 stops it)")   # from here on
    with early_signals.held(): ...       # a signal waits for the block's end (a submission)
    early_signals.outcome(0, "the job had already finished OK")   # the result is known
    early_signals.end(main())            # the program's last line (its __main__)
    early_signals.keep()                 # a rank (verl_hpc.job): kept for its PreemptionFlag
    early_signals.ignore()               # a rank past its last step: nothing left to stop

install: a signal prints `[submit] stopped by SIGTERM before any rank started; nothing was
submitted` on stderr and exits with 128 + its number, 143 for SIGTERM, 130 for Ctrl-C and 140 for
SIGUSR2 (Slurm's warning signal, which would otherwise end the program silently): the codes of a
stopped local job (docs/signals.md). It exits with os._exit: an exception raised from the
handler lands wherever the main thread is (inside an import, under some library's `except
BaseException`), where it can be swallowed or printed as a traceback, and nothing has been started
yet that would need cleaning up. Where the program starts things it hands the signals on (the
local launcher's LocalStop) or holds them (`held`).

outcome: once the program's result is known (the local job finished, stopped or failed), a signal
changes nothing: it prints `[submit] SIGTERM came after the job had already finished OK: nothing
left to stop` and exits with the result's code (0 there), not 143. `end` then ends the program
without Python's interpreter teardown: Python puts every signal it handles back to the default
before it frees the modules (half a second for torch's), and a signal in that half second ended a
finished job's submitter with 143 and no word. `end` joins the threads and runs the exit handlers
as Python would (a signal meanwhile still gets the line), flushes the output and leaves with
os._exit.

keep: a rank does not end at a signal in its start-up. Its launcher signals every rank at once and
the others may already be past theirs, in a collective with it: the signal is kept until
runtime.bootstrap has installed the rank's PreemptionFlag, which takes it over (`hand_over`), so
it means what it means later: checkpoint at the next step boundary, then stop. A second Ctrl-C
raises KeyboardInterrupt, as the flag's does.

ignore: a rank whose program has returned (its last step done, its result written) ignores the
three signals until it exits. Handled, a late one would be recorded and acted on by nobody; worse,
Python resets handled signals to the default as the interpreter exits, and a SIGUSR2 then killed a
rank that had saved step 6 of 6 (exit -12), which its submitter reported as a failed job. An
ignored signal stays ignored through that teardown.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, List, NoReturn, Optional, Tuple

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
# what a rank keeps: runtime/signals.py's DEFAULT_SIGNALS (the warning signal, SIGTERM, SIGINT),
# not imported from there because importing verl_hpc.runtime imports torch (a test keeps them equal)
RANK_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)

_program: Optional[str] = None  # install()'s: None where no entry point installed us (in-process use)
_where = ""
_kept: List[int] = []
_outcome: Optional[Tuple[int, str]] = None  # outcome(): the result's exit code and its words


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


def outcome(code: int, words: str) -> None:
    """The program's result is known: from now on a signal says `[program] NAME came after
    <words>: nothing left to stop` and exits with `code`, the result's own exit code."""
    global _outcome
    if _program is not None:  # in-process use keeps its own handlers (and its own exit)
        _outcome = (int(code), words)


def _stop(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    _flush()  # what the program printed so far comes first (os._exit flushes nothing)
    name = signal.Signals(signum).name
    if _outcome is not None:
        code, words = _outcome
        os.write(2, f"[{_program}] {name} came after {words}: nothing left to stop\n".encode())
        os._exit(code)
    os.write(2, f"[{_program}] stopped by {name} {_where}\n".encode())
    os._exit(128 + int(signum))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a flush interrupted mid-write by a signal, a closed stream
            pass


def end(code: int) -> NoReturn:
    """The program's exit with `code`. Once an outcome is declared, the signal handler stays in
    place to the last instruction (module docstring): the threads joined and the exit handlers run
    as Python's own exit does them, the output flushed, then os._exit, skipping the teardown."""
    if _outcome is None:
        sys.exit(code)
    main = threading.main_thread()
    for thread in threading.enumerate():  # what Python's exit waits for first
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers Python's own exit would run (logging's flush, ...)
    _flush()
    os._exit(code)


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


def ignore() -> None:
    """A rank past its last step: the signals it would act on are ignored until it exits."""
    for s in RANK_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def _keep(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    if signum == signal.SIGINT and signal.SIGINT in _kept:  # Ctrl-C twice: the user will not wait
        raise KeyboardInterrupt
    _kept.append(int(signum))


def hand_over(record: Callable[[int], None]) -> None:
    """Give each signal kept so far, in order, to `record` (PreemptionFlag.record), once."""
    while _kept:
        record(_kept.pop(0))
