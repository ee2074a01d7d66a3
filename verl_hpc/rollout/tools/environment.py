"""EnvironmentTurns: the responder of an episode runner for a user environment
(multi_turn.environment = 'package.module:Class'; the protocol is in registry.py). One instance per
episode, `reset(row)` when a batch's episodes start, `step(turn_text) -> (observation, reward,
done)` after every model turn; the reward is a per-turn term, the observation a user turn.

What a failure of the environment's code does (docs/multi_turn.md lists it for users):
- a class that cannot be built with no arguments, is not a class, lacks reset or step, or whose
  module fails to import: a ConfigError at start-up (registry.load_environment);
- `__init__()` or `reset(row)` raising anything, SystemExit included: a ConfigError naming the
  environment, the method and the row. The episode has no environment to answer it, and such a
  defect comes back on every batch;
- `step` raising anything: the model reads `error: <Type>: <message>` as the observation and the
  failure is counted (episode/tool_errors), as for a tool: the turn that made it fail is the
  model's, and a job must not end because a model wrote something a step chokes on;
- `step` returning something else than (observation, reward, done): a ConfigError (a defect of the
  code, whatever the turn);
- a reward that is not a finite number within float32's range (a string, a bool, NaN, inf): what
  `reward.on_error` says for a reward function's score: `zero` makes the term 0 and counts the
  failure, `raise` ends the job with a RewardError.

The environment's code runs on a worker thread of its own (the reward functions' TimedCaller):
there a SystemExit or a KeyboardInterrupt can only be the environment's own, while a real Ctrl-C
reaches the main thread and stops the job as it should. No time limit of its own (the calls are
allowed a week): a step that hangs is the stage watchdog's (trainer.stage_timeout_s), as before.
"""
from __future__ import annotations

import logging
import numbers
import reprlib
from typing import Any, Dict, List, Sequence

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.fields import WEEK_S
from verl_hpc.rewards.errors import RewardError
from verl_hpc.rewards.scorer import score_problem
from verl_hpc.rewards.timeout import FunctionExited, TimedCaller
from verl_hpc.rollout.episodes.runner import Reply, Turn

log = logging.getLogger(__name__)
FIELD = "multi_turn.environment"
STEP_RETURNS = "(observation: str or None, reward: a finite number, done: bool)"


class _BadReturn(Exception):
    """step returned something that is not (observation, reward, done)."""


class EnvironmentTurns:
    role = "user"
    stop = ()

    def __init__(self, env_class, spec: str, *, on_error: str):
        """spec: the 'module:Class' the job named (for messages); on_error: reward.on_error."""
        self.env_class, self.spec, self.on_error = env_class, spec, on_error
        self.envs: List[Any] = []
        self._calls = TimedCaller(WEEK_S)
        self._warned = False

    def start(self, rows: Sequence[Dict[str, Any]]) -> None:
        self.envs = []
        built = self._calls.call_each([(self.env_class, ())] * len(rows), stop_at_failure=True)
        self._stop_at_failure(built, "__init__()", rows, "it is built with no arguments, one instance per episode")
        envs = [env for _, env in built]
        reset = self._calls.call_each([(env.reset, (row,)) for env, row in zip(envs, rows)], stop_at_failure=True)
        self._stop_at_failure(reset, "reset(row)", rows, "the episode cannot start without it")
        self.envs = envs

    def respond(self, turns: Sequence[Turn]) -> List[Reply]:
        done = self._calls.call_each([(_step, (self.envs[t.episode].step, t.text)) for t in turns])
        return [self._reply(ok, out) for ok, out in done]

    def close(self) -> None:
        self.envs = []

    # ------------------------------------------------------------------ one step's outcome
    def _reply(self, ok: bool, out: Any) -> Reply:
        if not ok:
            if isinstance(out, _BadReturn):
                raise ConfigError(f"{FIELD} = {self.spec!r}: step(turn_text) {out}; expected {STEP_RETURNS}") from None
            self._warn_once(f"step(turn_text) raised {_what(out)}; the model reads it as the observation")
            return Reply(observations=[f"error: {_what(out)}"], errors=1)
        observation, reward, done = out
        obs = [] if done or observation is None else [observation]
        reply = Reply(observations=obs, done=done or not obs)
        problem = _reward_problem(reward)
        if not problem:
            reply.reward = 0.0 if reward is None else float(reward)
        elif self.on_error == "raise":
            raise RewardError(f"{FIELD} = {self.spec!r}: step(turn_text) returned {problem} (set "
                              "reward.on_error=zero to count such turns and give them 0)")
        else:
            self._warn_once(f"step(turn_text) returned {problem}; the turn's term is 0 (reward.on_error=zero)")
            reply.errors = 1
        return reply

    def _warn_once(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s = %r: %s; counted in episode/tool_errors, further failures only counted",
                        FIELD, self.spec, what)

    def _stop_at_failure(self, results, method: str, rows, why: str) -> None:
        for k, (ok, out) in enumerate(results):
            if not ok:
                raise ConfigError(f"{FIELD} = {self.spec!r}: {method} raised {_what(out)} (row "
                                  f"{reprlib.repr(rows[k])}); {why}") from None


def _step(step, text: str):
    """step(text) checked on the worker thread, where the conversions of what it returned (a
    __str__ or __bool__ of the environment's own) may fail like step itself."""
    out = step(text)
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        raise _BadReturn(f"returned {reprlib.repr(out)}")
    observation, reward, done = out
    if hasattr(reward, "item") and not isinstance(reward, numbers.Real):  # a 1-element tensor or array
        reward = reward.item()
    return (None if observation is None else str(observation)), reward, bool(done)


def _reward_problem(value) -> str:
    """'' for a valid reward term (what a reward function's score may be, or None for 0), else what
    it was."""
    problem = "" if value is None else score_problem(value)
    return f"reward {problem}" if problem else ""


def _what(exc: BaseException) -> str:
    """'Type: message' on one line; a SystemExit or KeyboardInterrupt as itself."""
    original = exc.original if isinstance(exc, FunctionExited) else exc
    text = " ".join(str(original).split())
    return f"{type(original).__name__}{': ' + text if text else ''}"
