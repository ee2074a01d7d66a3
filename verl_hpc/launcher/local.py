"""Local ranks on this machine through torch's elastic launcher (what `torchrun` runs).

It already does what a local job needs: one process per rank with RANK/WORLD_SIZE/MASTER_*,
per-rank log files, rank 0 teed to the console, and when one rank fails it stops the others at
once. Called in-process (not as a `torchrun` subprocess) so that a failure comes back as data:
which rank, its exit code and its log file, for the message the user reads.
"""
from __future__ import annotations

import os
import shlex
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from verl_hpc.launcher import early_signals
from verl_hpc.launcher.local_restarts import LocalRestarts
from verl_hpc.launcher.local_stop import (STOP_NOTES, LocalStop, early_stop_line, nothing_left_line, open_notes,
                                          stop_line, stop_note)
from verl_hpc.launcher.plan import Plan, exit_words, rank_label
from verl_hpc.launcher.restarts import SPENT_EXIT
from verl_hpc.launcher.slurm import error_line
from verl_hpc.runtime.orphans import LAUNCHER_PID


def rank_log(log_dir: Path, rank: int) -> Path | None:
    """The log file the launcher wrote for a rank in the newest launch (log_dir/<run id>-<launch>/attempt_0/<rank>/stderr.log)."""
    found = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"))
    return found[-1] if found else None


def by_time_of_death(failures: dict, log_dir: Path) -> list:
    """Failed ranks, the one that died first first. torch's failure timestamps are all taken when
    the launcher collects them (whole seconds, identical), so the time of death is the last write
    to the rank's log (its traceback, or its last line before a crash); a rank without a log goes
    last. Ties: a rank that exited on its own (exit code >= 0) before one the launcher killed."""
    def key(rank):
        log = rank_log(log_dir, rank)
        mtime = log.stat().st_mtime_ns if log is not None and log.exists() else float("inf")
        return (mtime, failures[rank].exitcode < 0, rank)

    return sorted(failures, key=key)


def rerun_command(argv: list[str], resume: str) -> str:
    """The submit command to run again after a stop: the same arguments, resuming from `latest`."""
    again = list(argv) + ([] if resume == "auto" else ["trainer.resume=auto"])
    return shlex.join(["python", "-m", "verl_hpc.submit", *again])


def run_local(plan: Plan, config_path: Path, *, checkpoint_dir=None, rerun: str = "") -> int:
    """Start the ranks and wait for them; 0, 1 (a rank failed), 34 (a rank died more often than
    slurm.max_restarts allows) or 128 + the number of a signal that stopped the job, sent to this
    process or to the ranks themselves (launcher/local_stop.py; checkpoint_dir and rerun go into its
    last line). A rank that dies is restarted with the others from `latest` (launcher/local_restarts.py)."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(plan.env)  # inherited by the rank processes
    os.environ[LAUNCHER_PID] = str(os.getpid())  # ranks stop if this process is killed (runtime/orphans.py)
    run_id = uuid.uuid4().hex[:8]
    restarts = LocalRestarts(plan, checkpoint_dir)
    print(f"[submit] starting {plan.world_size} local rank(s); logs in {plan.log_dir}", flush=True)
    failures, verdict = None, None
    # Once LocalStop gives the signals back a signal waits for the result to be printed, and then
    # changes nothing: it says the job had already ended and exits with the result's code.
    with early_signals.held():
        with LocalStop() as stop:
            while True:
                notes = open_notes(plan.log_dir)  # where a rank stopped by a signal says so
                restarts.launch_env()
                failures = None
                try:
                    with restarts.watching():
                        elastic_launch(_launch_config(plan, f"{run_id}-{restarts.attempt:02d}"), sys.executable)(
                            "-u", "-m", "verl_hpc.job", str(config_path))
                except ChildFailedError as err:
                    failures = err.failures
                finally:
                    os.environ.pop(STOP_NOTES, None)  # the ranks have it; nothing else this process starts
                verdict = restarts.after(failures, stop, by_time_of_death(failures, plan.log_dir) if failures else ())
                if verdict is None or verdict.action != "restart":
                    break
        code, words = conclude(plan, stop, failures, stop_note(notes), checkpoint_dir, rerun, verdict, restarts.lines)
        early_signals.outcome(code, words)
    return code


def _launch_config(plan: Plan, run_id: str) -> LaunchConfig:
    """One launch of the ranks. run_id names its log folder (log_dir/<run_id>/attempt_0/<rank>/):
    the launch's number last, so that the newest sorts last (rank_log)."""
    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=plan.tasks_per_node, run_id=run_id,
        # torch's own restarts stay off: each launch is ours (launcher/local_restarts.py says why)
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
        # every rank's stdout+stderr go to its file; rank 0's is also shown here
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.log_dir), redirects=Std.ALL, tee=Std.ALL,
                                    local_ranks_filter={0}),
        # When one rank fails the launcher sends the others SIGTERM, which our ranks take as
        # "checkpoint at the next step boundary" (runtime/signals.py); a rank that never reaches
        # one is killed 30 s later (torch's fixed grace period on this path).
        start_method="spawn",
        # SIGTERM, SIGINT (and SIGUSR2, which torch leaves alone) are LocalStop's: the ranks get
        # time to checkpoint
        signals_to_handle="SIGHUP,SIGQUIT")


def conclude(plan: Plan, stop: LocalStop, failures, note, checkpoint_dir, rerun: str, verdict=None,
             restarted=()) -> tuple[int, str]:
    """Print how the job ended (the submitter's last line, or the failed ranks); returns the exit
    code and the words a later signal's line ends with. note: the ranks' (launcher/local_stop.py);
    verdict: the restart rules' on the last launch (None: no rule applied); restarted: the lines of
    the restarts made."""
    if failures is not None:
        if stop.signum and (stop.abandoned or all(_by_signal(f) for f in failures.values())):
            print(stop_line(stop, checkpoint_dir, rerun, note), flush=True)
            return stop.exit_code, "the job had already stopped (the line above)"
        report_failures(failures, plan.log_dir, rollout_ranks=plan.rollout_ranks)
        if verdict is not None and verdict.exit_code == SPENT_EXIT:
            return SPENT_EXIT, "the job had already failed (the ranks above; its restarts spent)"
        return 1, "the job had already failed (the ranks above)"
    if note is not None and note.signal is not None:  # the ranks stopped early on a signal (and saved)
        # sent to us (and passed on), or to the ranks themselves
        print(stop_line(stop, checkpoint_dir, rerun, note) if stop.signum else
              early_stop_line(note, checkpoint_dir, rerun), flush=True)
        return (stop.exit_code if stop.signum else note.exit_code), "the job had already stopped (the line above)"
    # every rank ran to its end: a signal passed on to them after their last step stopped nothing
    if note is not None:  # resumed at its last step
        print(nothing_left_line(note, checkpoint_dir, plan.log_dir), flush=True)
    elif stop.signum:
        print(f"[submit] local job finished OK ({signal.Signals(stop.signum).name} came too late to stop it: "
              f"the ranks had reached their last step); logs in {plan.log_dir}", flush=True)
    else:
        again = f" after {len(restarted)} restart(s) of its ranks (the [restart] lines above)" if restarted else ""
        print(f"[submit] local job finished OK{again}; logs in {plan.log_dir}", flush=True)
    return 0, "the job had already finished OK"


def _by_signal(failure) -> bool:
    """A rank that died of a signal (one that came before it could record it), not of an error."""
    return failure.exitcode < 0 or failure.exitcode > 128


def report_failures(failures: dict, log_dir: Path, *, rollout_ranks: int = 0) -> None:
    """One line per failed rank, the first to die first, with its group in a split job
    (rollout_ranks > 0), its exit code (a signal named) and its log's `error:` line."""
    print(f"[submit] local job FAILED; logs in {log_dir}", file=sys.stderr)
    order = by_time_of_death(failures, log_dir)
    for i, rank in enumerate(order):
        first = " (failed first)" if i == 0 and len(order) > 1 else ""
        log = rank_log(log_dir, rank)
        said = error_line(log) if log is not None else ""
        print(f"[submit]   {rank_label(rank, rollout_ranks)} exited with code "
              f"{exit_words(failures[rank].exitcode)}{first}; "
              f"log: {log}" + (f"\n[submit]     {said}" if said else ""), file=sys.stderr)
