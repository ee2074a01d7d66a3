"""One agent run: the user's callable on a thread of its own, with a time limit, and its verdict.

    outcome = run_agent(fn, row, client_config, timeout_s)     # never raises for the agent's fault

The callable is `fn(row, client_config) -> reward` or `(reward, info)`; a reward is a finite number
(not a bool), info a dict. What can go wrong is the agent's, never the job's: it raises (any
exception, SystemExit too), outlives `timeout_s`, calls the model more than agent.max_calls times
(the endpoint answers 429: `flooded`), calls it never (`no_calls`: there is nothing to train on),
or returns something that is not a reward (`bad_reward`). Each is an `Outcome.failure` kind; the
runner gives the sample reward.on_error's treatment.

A Python thread cannot be killed: an agent past its time limit keeps its thread until it returns,
but its run is closed at once, so its later model calls are refused (HTTP 409) and recorded nowhere,
and the step goes on without it.
"""
from __future__ import annotations

import dataclasses
import threading
import traceback
from typing import Any, Callable, Dict

from verl_hpc.rewards.scorer import score_problem

# `exited`: a command-line agent's non-zero exit or a sandbox limit (command.py)
FAILURES = ("raised", "timeout", "flooded", "no_calls", "bad_reward", "exited")


@dataclasses.dataclass
class Outcome:
    reward: float = 0.0
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)
    failure: str = ""  # one of FAILURES, "" when the run succeeded
    detail: str = ""  # what went wrong (a traceback for `raised`)
    seconds: float = 0.0


def run_agent(fn: Callable, row: Dict[str, Any], client_config: Dict[str, Any], timeout_s: float) -> Outcome:
    box: Dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(row, client_config)
        except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from user code too
            box["error"] = "".join(traceback.format_exception(e))

    thread = threading.Thread(target=target, name="agent-run", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return Outcome(failure="timeout", detail=f"the agent ran past agent.timeout_s = {timeout_s:g} s")
    if "error" in box:
        return Outcome(failure="raised", detail=box["error"])
    return verdict(box.get("value"))


def verdict(value: Any) -> Outcome:
    """The agent's return value as an Outcome (bad_reward where it is not a reward)."""
    info: Dict[str, Any] = {}
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], dict):
            return Outcome(failure="bad_reward", detail=f"returned a tuple of {len(value)} items; expected "
                                                        "reward or (reward, info dict)")
        value, info = value
    problem = score_problem(value)
    if problem:
        return Outcome(failure="bad_reward", detail=f"returned {problem}")
    return Outcome(reward=float(value), info=info)


def first_failure_text(sample_id: str, outcome: Outcome) -> str:
    return f"sample {sample_id}: agent run failed ({outcome.failure}): {outcome.detail}".rstrip()


def failed(outcome: Outcome, kind: str, detail: str) -> Outcome:
    """`outcome` marked as failed (a run that returned, but flooded the endpoint or made no call)."""
    return dataclasses.replace(outcome, reward=0.0, failure=kind, detail=detail)
