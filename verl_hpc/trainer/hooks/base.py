"""The per-step bookkeeping of a training loop as ordered hooks, and the loop that runs them.

    run = RunState(tracker, timer, watchdog, summary, total_steps=...)
    run_steps(step_fn, [validate, task_weights, rollback, log, checkpoint, stop_rule, preemption], run)

After each step the hooks run in list order, each with the step, its metrics (a hook may add to
them: the ones after it, and the tracker, see what it added) and the RunState; each answers
CONTINUE, Rewind(step) (a checkpoint of `step` was loaded: the loop runs on from step + 1 and the
hooks after this one do not run for the undone step) or Stop(outcome, reason) (the loop ends;
summary["stopped"] = outcome, summary["stop_reason"] = reason when there is one). A hook with a
`stage` names it to the stage watchdog before it runs, so a rank stuck in a hook is reported as
stuck there. Hooks get what they act on when they are built (a checkpointer, a validator), not
the trainer, so each can be tested and reordered alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Union


@dataclass(frozen=True)
class Continue:
    pass


@dataclass(frozen=True)
class Rewind:
    step: int  # the step of the checkpoint loaded; the loop runs on from step + 1


@dataclass(frozen=True)
class Stop:
    outcome: str  # summary["stopped"]: stop_at (a planned end) or preempted
    reason: Optional[str] = None  # summary["stop_reason"] when given


CONTINUE = Continue()
Verdict = Union[Continue, Rewind, Stop]


@dataclass
class RunState:
    """What the hooks share across steps: where metrics go, the step timer, the summary."""
    tracker: Any
    timer: Any  # a WatchedTimer: hooks exclude their own time from the next step's with timer.exclude
    watchdog: Any  # StageWatchdog; .stage(name)
    summary: Dict[str, Any]
    total_steps: int
    start: int = 0  # the step resumed from (0: a fresh run)

    def last(self, step: int) -> bool:
        return step == self.total_steps


class Hook(Protocol):
    stage: Optional[str]  # the watchdog stage it runs under; None: the one before it

    def __call__(self, step: int, metrics: Dict[str, float], run: RunState) -> Verdict: ...


def run_steps(step_fn: Callable[[int], Dict[str, float]], hooks: Sequence[Hook], run: RunState) -> None:
    """Steps run.start + 1 .. run.total_steps, each followed by the hooks in order (module docstring)."""
    step = run.start + 1
    while step <= run.total_steps:
        metrics = step_fn(step)
        for hook in hooks:
            if hook.stage:
                run.watchdog.stage(hook.stage)
            verdict = hook(step, metrics, run)
            if isinstance(verdict, Rewind):
                step = verdict.step + 1
                break
            if isinstance(verdict, Stop):
                run.summary["stopped"] = verdict.outcome
                if verdict.reason is not None:
                    run.summary["stop_reason"] = verdict.reason
                return
        else:
            step += 1


# ------------------------------------------------------------------------------ generic hooks
class LogHook:
    """The step into the summary (steps, a short history, the headline metric) and the tracker.
    history_prefixes: the metrics kept in summary["history"] (None: all); headline: a metric
    copied to summary[headline's summary name] after every step (RL: reward/score/mean as
    reward_mean)."""
    stage = "log"

    def __init__(self, history_prefixes=None, headline=None):
        self.history_prefixes = tuple(history_prefixes) if history_prefixes is not None else None
        self.headline = headline  # (summary key, metric name) or None

    def __call__(self, step, metrics, run):
        s = run.summary
        s["steps"] = step
        if self.headline is not None:
            key, metric = self.headline
            s[key] = metrics.get(metric)
        kept = (metrics if self.history_prefixes is None else
                {k: v for k, v in metrics.items() if k.startswith(self.history_prefixes)})
        s.setdefault("history", []).append(dict(kept))
        run.tracker.log(metrics, step)
        return CONTINUE


class CheckpointHook:
    """checkpoint.save_every (and the last step): checkpointer.maybe_save."""
    stage = "checkpoint"

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def __call__(self, step, metrics, run):
        self.checkpointer.maybe_save(step)
        return CONTINUE


class PreemptionHook:
    """Slurm's warning signal or SIGTERM on any rank: save and stop (the program requeues)."""
    stage = None

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def __call__(self, step, metrics, run):
        if run.last(step):  # the run's last step, saved by CheckpointHook: a signal has nothing left to stop
            return CONTINUE  # (every rank skips the same collective), and a Slurm job is not requeued for it
        return Stop("preempted") if self.checkpointer.stop_if_preempted(step) else CONTINUE
