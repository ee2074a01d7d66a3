"""Episodes: model turn, tool (or environment) turn, model turn, ... as one token sequence.

    runner = EpisodeRunner(engine, codec, responder, max_turns=mt.max_turns, budget=d.max_response_length)
    result = runner.generate(prompt_ids, spec, rows=prompt_extras)   # a RolloutResult of episodes

Token in, token out. A model turn's tokens are appended exactly as the engine sampled them, with
their log-probs and mask 1. What follows them (the template's end of turn, the tool turns holding
the tools' output, the next assistant header) is tokenized once by `TurnCodec` and appended with
mask 0 and log-prob 0; nothing already in the episode is ever decoded and encoded again. The
result's `response_ids` is the whole episode after the prompt, its `response_mask` says which tokens
the model wrote, and the trainer's loss, advantages, critic and KL see only those (the batch's
response mask, verl_hpc/engines/batch.py).

How a batch of episodes runs (every rank in lockstep: `engine.generate` is a collective):
  1. the first model turn of all P x n episodes is ONE generate call (n samples per prompt);
  2. rank 0 hands every finished turn to the responder (tool calls run concurrently in its pool,
     verl_hpc/rollout/tools/) and broadcasts the replies, so every rank appends the same tokens;
  3. the episodes that go on are continued in ONE generate call (n = 1 each, the episode so far as
     the prompt), so vLLM batches the next turns of all of them; back to 2 until none is left.
An episode ends when the model answers (a turn without a tool call; the environment's done), at
max_turns model turns, when its tokens reach `budget` (data.max_response_length: the whole episode
after the prompt), or when the batch's episodes have run `timeout_s`. A turn cut at
rollout.max_tokens is a turn like any other (its calls run; without one it is the answer). One generate call serves
episodes with different room left: it asks for the most any of them has, and each episode keeps
only the first tokens up to its own limit (a prefix of what was sampled is still exactly what the
policy sampled; vLLM itself stops a sequence at its window).

Seeds: turn t of a call samples with a seed derived from (spec.seed, "turn", t), and the engine
derives each request's seed from its index in the call, so a batch of episodes is a pure function
of (weights, prompts, spec, tool outputs), like single-turn generation.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from verl_hpc.rollout.episodes.chat_turns import TurnCodec
from verl_hpc.rollout.result import EpisodeStats, RolloutResult
from verl_hpc.rollout.sampling import SamplingSpec, request_seed
from verl_hpc.runtime.objects import broadcast_object

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Turn:
    """A finished model turn handed to the responder."""
    episode: int  # index of the episode in the batch
    text: str  # the turn's text (special tokens dropped)
    offered: Sequence[str]  # the tools this episode's row offers


@dataclasses.dataclass
class Reply:
    """The responder's answer to one turn."""
    observations: List[str]  # texts of the turns appended (one per tool call); [] with done
    done: bool = False  # the episode ends here (the model answered)
    reward: float = 0.0  # a per-turn reward term, placed on the turn's last model token
    calls: int = 0
    errors: int = 0
    seconds: List[float] = dataclasses.field(default_factory=list)  # per call


class Responder(Protocol):
    role: str  # the chat role of its observations: "tool", or "user" for an environment
    stop: tuple  # stop strings that end a model turn early (the end of a tool call)

    def start(self, rows: Sequence[Dict[str, Any]]) -> None:
        """A new batch of episodes; rows[e] is episode e's data row (its `extra`)."""

    def respond(self, turns: Sequence[Turn]) -> List[Reply]:
        """One reply per turn, in order; never raises for a tool's or the model's fault."""

    def close(self) -> None:
        """Stop its workers."""


@dataclasses.dataclass
class _Episode:
    prompt: List[int]
    prompt_index: int
    sample_index: int
    offered: Sequence[str]
    tokens: List[int] = dataclasses.field(default_factory=list)
    mask: List[int] = dataclasses.field(default_factory=list)
    logprobs: List[float] = dataclasses.field(default_factory=list)
    turn_start: int = 0
    stats: EpisodeStats = dataclasses.field(default_factory=EpisodeStats)
    done: bool = False

    def append(self, ids: Sequence[int], *, model: bool, logprobs: Sequence[float] = ()) -> None:
        self.tokens.extend(ids)
        self.mask.extend([1 if model else 0] * len(ids))
        self.logprobs.extend(logprobs if model else [0.0] * len(ids))

    def finish(self, end: str) -> None:
        self.done, self.stats.end = True, end


class EpisodeRunner:
    def __init__(self, engine, codec: TurnCodec, responder: Responder, *, max_turns: int, budget: int,
                 timeout_s: float = 0.0, default_tools: Sequence[str] = (),
                 share: Callable[[Any], Any] = broadcast_object, is_root: bool = True):
        """budget: tokens of an episode after its prompt (model, tool and template tokens together).
        default_tools: offered to a row that names none. share(obj) -> rank 0's obj on every rank;
        is_root: this rank runs the responder."""
        self.engine, self.codec, self.responder = engine, codec, responder
        self.default_tools = tuple(default_tools)
        self.max_turns, self.budget, self.timeout_s = int(max_turns), int(budget), float(timeout_s)
        self.share, self.is_root = share, is_root

    def generate(self, prompts: List[List[int]], sampling: SamplingSpec, *,
                 rows: Optional[Sequence[Dict[str, Any]]] = None,
                 offered: Optional[Sequence[Optional[Sequence[str]]]] = None) -> RolloutResult:
        """P prompts -> P x n episodes, rows in (prompt, sample) order like engine.generate.
        rows[i]: prompt i's data row for an environment's reset; offered[i]: its tools (None: the
        default tools)."""
        start = time.perf_counter()
        extra_stop = tuple(x for x in getattr(self.responder, "stop", ()) if x not in sampling.stop)
        sampling = dataclasses.replace(sampling, stop=tuple(sampling.stop) + extra_stop)
        first = self.engine.generate(prompts, dataclasses.replace(
            sampling, max_tokens=min(sampling.max_tokens, self.budget)))
        episodes = [_Episode(prompt=first.prompts[i], prompt_index=i, sample_index=j,
                             offered=tuple((offered[i] if offered else None) or self.default_tools))
                    for i, j in zip(first.prompt_index, first.sample_index)]
        if self.is_root:
            self.responder.start([dict(rows[e.prompt_index]) if rows else {} for e in episodes])
        live = list(range(len(episodes)))
        self._absorb(episodes, live, first, sampling)
        turn = 1
        while True:
            live = [e for e in live if not episodes[e].done]
            if not live:
                break
            self._respond(episodes, live, start)
            live = [e for e in live if not episodes[e].done]
            if not live:
                break
            self._next_turn(episodes, live, sampling, turn)
            turn += 1
        return self._result(episodes, first, time.perf_counter() - start)

    def tool_schemas(self) -> Optional[Dict[str, dict]]:
        """{name: function schema} of the tools the prompts list (rank 0; None: an environment)."""
        schemas = getattr(self.responder, "schemas", None)
        return schemas() if schemas is not None else None

    def close(self) -> None:
        self.responder.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ model turns
    def _limit(self, ep: _Episode, per_turn: int) -> int:
        return min(per_turn, self.budget - len(ep.tokens))

    def _absorb(self, episodes, which: Sequence[int], result: RolloutResult, sampling: SamplingSpec) -> None:
        """Append each row of `result` (row k -> episode which[k]) as a model turn, cut to the
        episode's room. A turn that fills the episode's budget ends it; one cut at rollout.max_tokens
        with budget left is still a turn: the responder reads it (verl's agent loop does the same)."""
        for k, e in enumerate(which):
            ep = episodes[e]
            room = self._limit(ep, sampling.max_tokens)  # a prefix of what was sampled is still the policy's
            ids, lps = result.response_ids[k][:room], result.logprobs[k][:room]
            ep.turn_start = len(ep.tokens)
            ep.append(ids, model=True, logprobs=lps)
            ep.stats.turns += 1
            if len(ep.tokens) >= self.budget or not ids:
                ep.finish("length")

    def _next_turn(self, episodes, live: Sequence[int], sampling: SamplingSpec, turn: int) -> None:
        most = max(self._limit(episodes[e], sampling.max_tokens) for e in live)
        spec = dataclasses.replace(sampling, n=1, max_tokens=most,
                                   seed=request_seed(sampling.seed, "turn", turn) % 2**31)
        have = max(len(episodes[e].tokens) for e in live)
        result = self.engine.generate([episodes[e].prompt + episodes[e].tokens for e in live], spec, room=have)
        self._absorb(episodes, live, result, sampling)

    # ------------------------------------------------------------------ tool turns
    def _respond(self, episodes, live: Sequence[int], start: float) -> None:
        """Rank 0 asks the responder about every finished turn; all ranks apply its replies."""
        replies, timed_out = None, False
        if self.is_root:
            tok = self.codec.tokenizer
            turns = [Turn(e, tok.decode(episodes[e].tokens[episodes[e].turn_start:], skip_special_tokens=True),
                          episodes[e].offered) for e in live]
            replies = self.responder.respond(turns)
            timed_out = bool(self.timeout_s) and time.perf_counter() - start > self.timeout_s
        replies, timed_out = self.share((replies, timed_out))
        for e, reply in zip(live, replies):
            self._apply(episodes[e], reply, timed_out)

    def _apply(self, ep: _Episode, reply: Reply, timed_out: bool) -> None:
        s = ep.stats
        s.tool_calls += reply.calls
        s.tool_errors += reply.errors
        s.tool_seconds.extend(reply.seconds)
        if reply.reward:
            s.turn_rewards.append((_last_model_token(ep), float(reply.reward)))
        if reply.done or not reply.observations:
            return ep.finish("answered")
        if timed_out:
            return ep.finish("timeout")
        if s.turns >= self.max_turns:
            return ep.finish("max_turns")
        ids = self.codec.close_ids(ep.tokens[-1]) + self.codec.observation_ids(reply.observations,
                                                                               self.responder.role)
        room = self.budget - len(ep.tokens)
        ep.append(ids[:room], model=False)
        if len(ids) >= room:  # no room left for the model's next turn
            ep.finish("length")

    # ------------------------------------------------------------------ the result
    def _result(self, episodes: List[_Episode], first: RolloutResult, seconds: float) -> RolloutResult:
        tok = self.codec.tokenizer
        for ep in episodes:
            ep.stats.answer = tok.decode(ep.tokens[ep.turn_start:_last_model_token(ep) + 1],
                                         skip_special_tokens=True) if any(ep.mask) else ""
        return RolloutResult(
            prompts=first.prompts, prompt_index=[ep.prompt_index for ep in episodes],
            sample_index=[ep.sample_index for ep in episodes],
            response_ids=[ep.tokens for ep in episodes], logprobs=[ep.logprobs for ep in episodes],
            finish_reason=["stop" if ep.stats.end == "answered" else "length" for ep in episodes],
            num_truncated=first.num_truncated, seconds=seconds, adapter_version=first.adapter_version,
            response_mask=[ep.mask for ep in episodes], episodes=[ep.stats for ep in episodes])


def _last_model_token(ep: _Episode) -> int:
    """Response position of the episode's last model token (0 when it has none)."""
    for pos in range(len(ep.mask) - 1, -1, -1):
        if ep.mask[pos]:
            return pos
    return 0
