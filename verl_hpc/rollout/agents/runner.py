"""Agent programs as the rollout: a batch of prompts -> agent runs -> a RolloutResult.

    runner = AgentRunner(engine, tokenizer, AgentOptions(...), ctx)      # starts the endpoint
    result = runner.generate(prompt_batch, spec)                          # P x n runs
    runner.close()                                                        # stops it

Each rank serves the endpoint over its own engine and runs the agents of its own prompts (the
replica layout's shard: rollout.tp = 1, so each rank is a replica); the records are then gathered,
so every rank builds the same global result, as `engine.generate` returns it.

Per sample: its run's calls are laid out as trajectories (trajectory.py); the sample's rows are
its trajectories, each a row of the prompt's group, with mask 1 on the sampled tokens only. A run
that failed (runs.py FAILURES) follows reward.on_error: `zero` gives its rows reward 0, counts it
and logs the first failure; `raise` stops the job with a RewardError naming the sample. A run that
made no call (it returned or raised first, or its command was not found) has no sampled token: its
one row holds the data prompt alone, with `AgentStats.trained` false. It counts in the metrics and
in validation as any failed run; the training step leaves it out of the batch (`untrained_rows`)
before anything reads its empty response, so it is not in its group's baseline either: the policy
did nothing in that run. A training batch in which no run made a call has nothing to train on and
stops with the first failure (validation goes on: its runs count as failed). The reward is the
run's own: no reward function runs (verl_hpc/trainer/stages/scoring.py given_rewards).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import logging
import secrets
import time
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from verl_hpc.config.errors import ConfigError
from verl_hpc.rewards.custom import load_user_object
from verl_hpc.rewards.errors import RewardError
from verl_hpc.config.sections.multi_turn import SandboxConfig
from verl_hpc.rollout.agents.batcher import Batcher
from verl_hpc.rollout.agents.command import CommandAgents, check_read_only
from verl_hpc.rollout.agents.runs import Outcome, failed, first_failure_text, run_agent
from verl_hpc.rollout.agents.server import AgentServer
from verl_hpc.rollout.agents.service import AgentService, Session
from verl_hpc.rollout.agents.trajectory import Call, Trajectory, merge_calls
from verl_hpc.rollout.result import EpisodeStats, RolloutResult

log = logging.getLogger(__name__)
# the HTTP clients agents use log every request at INFO: the job's log would become an access log
CLIENT_LOGGERS = ("httpx", "httpx2", "httpcore", "openai")
ROW_FIELD = "agent"  # a row's own agent: extra["agent"] = 'package.module:function'
COMMAND_FIELD = "agent_command"  # or a command line run in the sandbox: extra["agent_command"]
ENDED_KEPT = 1 << 16  # ended runs' keys remembered, so a late call gets 409 (run ended), not 404


@dataclasses.dataclass(frozen=True)
class AgentOptions:
    """What the runner is built from: the agent section and the values it reads from others."""
    agent: Any  # the agent section
    on_error: str  # reward.on_error
    allow_custom_code: bool  # safety.allow_custom_code
    max_tokens: int  # rollout.max_tokens (resolved): one completion at most
    sandbox: Any = None  # the sandbox section: where command-line agents run


@dataclasses.dataclass
class AgentStats:
    """A row's record. The sample-level counts sit on the sample's first row (0 on the others)."""
    reward: float
    sample_first: bool
    calls: int = 0  # model calls of the sample's run (recorded ones)
    merges: int = 0  # calls that extended a trajectory token for token
    splits: int = 0  # calls that started a trajectory of their own after the first
    reused: int = 0  # chat calls whose history the endpoint rebuilt from its own ids
    failure: str = ""  # runs.FAILURES kind, "" on success
    trained: bool = True  # False: a run without a model call, its row the data prompt alone (untrained_rows)


@dataclasses.dataclass
class _Record:
    """One sample's result, as rank 0 and every other rank receive it."""
    prompt_index: int
    sample_index: int
    calls: List[Call]
    outcome: Outcome
    reused: int


class AgentRunner:
    def __init__(self, engine, tokenizer, options: AgentOptions, ctx=None):
        a = options.agent
        check_read_only(a.read_only_paths)
        self.engine, self.tokenizer, self.options, self.section = engine, tokenizer, options, a
        self.rank = getattr(ctx, "rank", 0)
        self.default = (load_user_object("agent.function", a.function, RewardError) if a.function else None)
        self._loaded: Dict[str, Any] = {}
        self.sessions: Dict[str, Session] = {}
        self._ended: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self._ended_session = Session("", 0)
        self._ended_session.close()  # what an ended run's key finds: every call gets 409
        self.batcher = Batcher(engine, window_s=a.batch_window_ms / 1000.0, max_batch=a.max_batch,
                               live=lambda: len(self.sessions),
                               due=self._due)
        self.service = AgentService(self.batcher, tokenizer, model_name=a.model_name,
                                    max_tokens=options.max_tokens, window=engine.window)
        # a connection idle longer than a whole run belongs to a run that ended
        try:
            self.server = AgentServer(self.service, self._session, port=a.port, idle_timeout_s=a.timeout_s + 30)
        except OSError as e:
            self.batcher.close()
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"agent.port = {a.port} is already in use on this node: pick a free port, or "
                                  "agent.port = 0 (the default: each rank a free port)") from None
            raise
        self.commands = CommandAgents(options.sandbox or SandboxConfig(), a.read_only_paths, self.server,
                                      a.model_name)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=a.concurrency, thread_name_prefix="agent")
        self.failures_total = 0
        self.first_failure: Optional[str] = None
        for name in CLIENT_LOGGERS:
            logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))
        log.info("agent endpoint on rank %d: http://%s:%d (loopback only; %d runs at once, batching window %g ms)",
                 self.rank, self.server.host, self.server.port, a.concurrency, a.batch_window_ms)

    def _session(self, key: str) -> Optional[Session]:
        """The server's lookup: a live run's Session, a closed one for a run that ended, else None."""
        found = self.sessions.get(key)
        if found is None and key in self._ended:
            return self._ended_session
        return found

    def _due(self, horizon: float) -> int:
        """Live runs whose next request is likely on its way (Session.due): the batcher waits for them."""
        now = time.monotonic()
        return sum(s.due(now, horizon) for s in list(self.sessions.values()))

    # ------------------------------------------------------------------ one batch
    def generate(self, prompts, sampling) -> RolloutResult:
        """P prompts (a PromptBatch) -> their P x n runs' rows, in (prompt, sample) order."""
        start = time.perf_counter()
        self.batcher.use(sampling)
        shard = self.engine.layout.shard(len(prompts))
        jobs = [(i, j) for i in shard for j in range(sampling.n)]
        futures = [self.pool.submit(self._run, prompts, i, j) for i, j in jobs]
        local = [f.result() for f in futures]
        records, failures = self._gather(local, self._engine_failure())
        if failures:
            raise RuntimeError(f"agent endpoint: the rollout engine failed during the agents' runs: {failures[0]}")
        records.sort(key=lambda r: (r.prompt_index, r.sample_index))
        self._count_failures(records, prompts)
        return self._result(prompts, records, time.perf_counter() - start)

    def _engine_failure(self) -> str:
        """Why this rank's engine is unusable ("" when it is not): its thread stopped, or it raised on
        every request of the step (a broken engine; a bad request fails alone, batcher.py)."""
        b = self.batcher
        if b.failure is not None:
            return repr(b.failure)
        if b.step_failed and not b.step_served:
            return f"it raised on all {b.step_failed} requests of the step; the first: {b.first_error}"
        return ""

    def _run(self, prompts, i: int, j: int) -> _Record:
        key = secrets.token_urlsafe(12)
        session = Session(key, self.section.max_calls)
        self.sessions[key] = session
        try:
            fn, command = self._agent(prompts, i)
            row = {"id": prompts.ids[i], "prompt": prompts.prompt_texts[i], "data_source": prompts.data_sources[i],
                   "ground_truth": prompts.ground_truths[i], "extra": dict(prompts.extras[i]), "sample_index": j}
            t0 = time.perf_counter()
            if command:
                outcome = self.commands.run(command, row, key, self.section.timeout_s)
            else:
                client = {"base_url": self.server.base_url(key), "api_key": self.server.token,
                          "model": self.section.model_name, "timeout": self.section.timeout_s}
                outcome = run_agent(fn, row, client, self.section.timeout_s)
            outcome.seconds = time.perf_counter() - t0
        finally:
            session.close()  # a run past its limit: its later calls are refused
            self._ended[key] = None
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            self.sessions.pop(key, None)
        if outcome.failure in ("", "raised", "exited") and session.flooded:  # raised on its own 429, most likely
            outcome = failed(outcome, "flooded", f"called the model more than agent.max_calls = {session.max_calls} times")
        if not outcome.failure and not session.calls:
            outcome = failed(outcome, "no_calls", "returned without calling the model: nothing to train on")
        return _Record(i, j, list(session.calls), outcome, session.reused)

    def _agent(self, prompts, i: int) -> Tuple[Any, str]:
        """(callable, "") or (None, command line): the row's own agent, else the section's."""
        command = prompts.extras[i].get(COMMAND_FIELD) or ""
        if command:
            if not isinstance(command, str) or not command.strip():
                raise RewardError(f"sample {prompts.ids[i]}: extra.{COMMAND_FIELD} = {command!r}: expected a "
                                  "command line (a non-empty string)")
            if not self.options.allow_custom_code:
                raise RewardError(f"sample {prompts.ids[i]}: extra.{COMMAND_FIELD} runs your own code: set "
                                  "safety.allow_custom_code=true to allow it")
            return None, command
        if prompts.extras[i].get(ROW_FIELD) or self.default is not None or not self.section.command:
            return self._function(prompts, i), ""
        return None, self.section.command

    def _function(self, prompts, i: int):
        spec = prompts.extras[i].get(ROW_FIELD) or ""
        if not spec:
            if self.default is None:
                raise RewardError(f"sample {prompts.ids[i]}: no agent to run: the row has no extra.{ROW_FIELD} "
                                  f"or extra.{COMMAND_FIELD}, and agent.function and agent.command are empty")
            return self.default
        if spec not in self._loaded:
            if not self.options.allow_custom_code:
                raise RewardError(f"sample {prompts.ids[i]}: extra.{ROW_FIELD} runs your own code: set "
                                  "safety.allow_custom_code=true to allow it")
            self._loaded[spec] = load_user_object(f"sample {prompts.ids[i]} extra.{ROW_FIELD}", spec, RewardError)
        return self._loaded[spec]

    def _gather(self, local: List[_Record], failure: str) -> Tuple[List[_Record], List[str]]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return list(local), [failure] if failure else []
        parts: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (local, failure))
        return [r for recs, _ in parts for r in recs], [f for _, f in parts if f]

    # ------------------------------------------------------------------ failures
    def _count_failures(self, records: List[_Record], prompts) -> None:
        bad = [r for r in records if r.outcome.failure]
        if not bad:
            return
        first = first_failure_text(prompts.ids[bad[0].prompt_index], bad[0].outcome)
        if self.options.on_error == "raise":
            raise RewardError(f"{first.splitlines()[0]} (set reward.on_error=zero to give such samples reward 0 "
                              "and go on)")
        self.failures_total += len(bad)
        if self.first_failure is None:
            self.first_failure = first
            log.error("agent run failed; its sample gets reward 0 (reward.on_error=zero); further failures are "
                      "only counted in agent/failures. First failure:\n%s", first)

    # ------------------------------------------------------------------ the result
    def _result(self, prompts, records: List[_Record], seconds: float) -> RolloutResult:
        """Rows in (prompt, sample) order; each row's prompt is its trajectory's first prompt
        (RolloutResult.row_prompts), its response everything after, mask 1 on the sampled ids."""
        out = RolloutResult([list(p) for p in prompts.prompt_ids], [], [], [], [], [], seconds=seconds,
                            response_mask=[], episodes=[], row_prompts=[])
        for rec in records:
            trajectories, merges, splits = merge_calls(rec.calls)
            trained = bool(trajectories)
            if not trained:  # a failed run without calls: the data prompt, nothing to train on
                trajectories = [Trajectory(prompt=list(prompts.prompt_ids[rec.prompt_index]))]
            reward = 0.0 if rec.outcome.failure else rec.outcome.reward
            for k, t in enumerate(trajectories):
                first = k == 0  # the sample's counts go on its first row only
                stats = AgentStats(reward, first, calls=len(rec.calls) if first else 0, merges=merges if first else 0,
                                   splits=splits if first else 0, reused=rec.reused if first else 0,
                                   failure=rec.outcome.failure if first else "", trained=trained)
                out.prompt_index.append(rec.prompt_index)
                out.sample_index.append(rec.sample_index)
                out.row_prompts.append(t.prompt)
                out.response_ids.append(t.tokens)
                out.response_mask.append(t.mask)
                out.logprobs.append(t.logprobs)
                out.finish_reason.append(t.finish_reason)
                out.episodes.append(EpisodeStats(turns=t.calls, end="answered" if t.finish_reason == "stop" else "length",
                                                 agent=stats))
        return out

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        for s in list(self.sessions.values()):
            s.close()
        self.commands.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server.close()
        self.batcher.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def untrained_rows(result) -> List[int]:
    """Rows of agent runs that made no model call (AgentStats.trained false): the data prompt alone,
    no sampled token. The training step leaves them out; metrics and validation count them. A
    RewardError when every row is one: a training batch with nothing to train on."""
    rows = [r for r, e in enumerate(result.episodes or ())
            if getattr(e, "agent", None) is not None and not e.agent.trained]
    if rows and len(rows) == len(result):
        first = next(e.agent for e in result.episodes if e.agent.sample_first)
        raise RewardError(f"none of the {sum(e.agent.sample_first for e in result.episodes)} agent runs of this "
                          f"batch made a model call: nothing to train on (the first failed: {first.failure}; "
                          "the job's log shows its traceback or output)")
    return rows
