"""The local submitter's in-job restart: torch's elastic launcher again, from `latest`, when a rank dies.

    loop = LocalRestarts(plan)
    while True:
        env = loop.launch_env()                      # VERL_HPC_ATTEMPT, the heartbeat folder: into os.environ
        with loop.watching():                        # a rank silent past the timeout is killed (and named)
            failures = <one elastic_launch>          # None: the ranks ended well
        verdict = loop.after(failures, stop)         # None: nothing to restart; else restart (line printed)
        if verdict is None or verdict.action != "restart": break

The rules are the Slurm supervisor's (launcher/restarts.py): a rank killed by a signal, ended by its
stage watchdog (16) or silent past trainer.heartbeat_timeout_s is dead, and the ranks are started
again from checkpoint.dir's `latest`, at most slurm.max_restarts times, after a back-off; an error
a rank reported is not restarted. Each launch is a fresh elastic_launch (its own rendezvous store on
a port of its own) rather than torch's `max_restarts`: torch would restart on any failure, a config
error's exit 2 included, and on torch 2.13 its restart reuses the first launch's store, whose stale
keys fail the next rendezvous over gloo (pytorch issue 135712, unless
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) so that one fault costs two restarts.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import List, Optional

from verl_hpc.launcher import heartbeat
from verl_hpc.launcher.local_stop import _latest, _step, rank_pids
from verl_hpc.launcher.restarts import ATTEMPT_ENV, Death, Ledger, Verdict, from_exit


class LocalRestarts:
    def __init__(self, plan, checkpoint_dir=None):
        self.plan, self.checkpoint_dir = plan, checkpoint_dir
        self.ledger = Ledger(plan.max_restarts, backoff_s=plan.restart_backoff_s)
        self.attempt = 0
        self.lines: List[str] = []  # the restart lines printed so far (the submitter's last line counts them)
        self.silent: List[Death] = []
        self.watch: Optional[heartbeat.Watch] = None

    @property
    def on(self) -> bool:
        return self.plan.max_restarts > 0

    def launch_env(self) -> dict:
        """This launch's variables, put into os.environ for the ranks (the launcher passes it on)."""
        env = {ATTEMPT_ENV: str(self.attempt)}
        self.silent, self.watch = [], None
        if self.on:  # the ranks beat with their trainer.heartbeat_timeout_s, which each beat carries
            folder = Path(self.plan.log_dir) / "heartbeats" / f"launch{self.attempt}"
            folder.mkdir(parents=True, exist_ok=True)
            env[heartbeat.ENV] = str(folder)
            self.watch = heartbeat.Watch(str(folder))
        os.environ.update(env)
        return env

    @contextlib.contextmanager
    def watching(self):
        """A thread that kills a rank whose heartbeat stopped (SIGKILL to its process group: its
        own children too); the launcher then sees it die and stops the others."""
        if self.watch is None:
            yield
            return
        done = threading.Event()

        def run() -> None:
            while not done.wait(self.watch.poll_s()):
                for rank, beat, seconds in self.watch.silent():
                    if beat.pid not in rank_pids():  # it ended (the launcher reports how): not stuck
                        continue
                    self.silent.append(Death(rank, "", f"no heartbeat for {seconds:.0f} s", True, beat.step or None))
                    print(f"[restart] rank {rank}: no heartbeat for {seconds:.0f} s (holding the GIL, stopped, "
                          "or stuck in the kernel): killed", flush=True)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(beat.pid, signal.SIGKILL)

        thread = threading.Thread(target=run, name="verl_hpc-heartbeat-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def after(self, failures: Optional[dict], stop, order=()) -> Optional[Verdict]:
        """The verdict on a launch that failed (None where it did not, restarts are off, or the job
        was stopped by a signal: a stop is never a fault). order: the failed ranks, the first to
        die first (launcher/local.py's by_time_of_death): the first is the cause, the others its
        collateral (a peer's error on the closed connection; a straggler the launcher itself killed
        after its 30 s grace, exit -9). A rank this watch killed is a cause wherever it falls. A
        restart's line is printed after its back-off, which a signal cuts short (then None: the
        stop's own line follows)."""
        if failures is None or not self.on or stop.signum:
            return None
        deaths = list(self.silent)
        if not deaths:
            first = (list(order) or sorted(failures))[0]
            deaths = [from_exit(first, failures[first].exitcode)._replace(step=self._step_of(first))]
        steps = [d.step for d in deaths if d.step]
        verdict = self.ledger.decide(deaths, step=max(steps) if steps else None)
        if verdict.action == "restart":
            end = time.monotonic() + verdict.wait_s
            while time.monotonic() < end and not stop.signum:
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))
            if stop.signum:
                return None
            self.attempt = verdict.attempt
        line = verdict.line(self._resume_step())
        print(line, flush=True)
        if verdict.action == "restart":
            self.lines.append(line)
        return verdict

    def _step_of(self, rank: int) -> Optional[int]:
        return self.watch.step_of(rank) if self.watch is not None else None

    def _resume_step(self) -> Optional[int]:
        latest = _latest(self.checkpoint_dir)
        return _step(latest) if isinstance(latest, Path) else None
