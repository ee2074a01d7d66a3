"""Concurrent requests -> batched generate calls on this rank's engine, from one thread.

Many agents call the endpoint at once, each waiting for its own completion. Serving them one by one
would run the engine at batch size 1; instead each request is queued and one engine thread gathers
a batch and samples it in one `generate_local` call per distinct set of stop strings. The engine is
only ever called from that thread, so the engines need no locking of their own.

When a batch closes (docs/agents.md, "Batching", has why each rule is there and what was measured):
- at `max_batch` requests;
- when every live run has a request in it (`live()`: an agent that waits for its reply cannot send
  another before these are answered);
- after a gap with no new request: `window_s`, or 2% of the last generate call's time if longer;
  the window slides with each arrival, up to 10 gaps in all;
- not before the runs that are due have sent (`due(horizon)`: no call in flight, and not yet
  called the model, or answered less than one generate call's time ago), up to one generate call's
  time from the batch's first request: the requests of a lockstep round come in a burst after a
  pause (agent threads share one GIL), and a batch served before them costs every later round.

A request may ask for fewer tokens than others in its batch: the call samples the most any of them
asks for and each keeps its first tokens (a prefix of what was sampled is still exactly what the
policy sampled; the episode runner does the same). Each generate call samples with a seed of its own
derived from the step's spec and the call's number, so a step's samples do not repeat the previous
step's noise.

A generate call that raises fails only its own requests, never the batcher: the requests of a failed
call of several are sampled again one by one, and each request that fails alone gets
`EngineRequestError` (HTTP 400 when the engine refused its input with a ValueError, 500 otherwise).
The runner stops the step only when the engine served nothing at all in it (`step_served` /
`step_failed`): a broken engine, not a bad request. A BaseException that is not an Exception
(KeyboardInterrupt) stops the batcher.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, List, Optional, Tuple

from verl_hpc.rollout.sampling import SamplingSpec, request_seed

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    prompt_ids: List[int]
    max_tokens: int
    stop: Tuple[str, ...]
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


@dataclasses.dataclass
class Sampled:
    ids: List[int]
    logprobs: List[float]
    finish_reason: str


class EngineClosed(RuntimeError):
    """The batcher stopped (the job shuts down, or the engine thread was interrupted) before serving
    a request. Not a VerlHpcError: the agent gets HTTP 503."""


class EngineRequestError(RuntimeError):
    """The engine raised on this request, sampled alone. Not a VerlHpcError: the agent gets HTTP 400
    (`refused`: the engine refused its input, a ValueError) or 500; the batcher goes on."""

    def __init__(self, message: str, refused: bool):
        super().__init__(message)
        self.refused = refused


class Batcher:
    def __init__(self, engine, *, window_s: float, max_batch: int, live: Callable[[], int] = lambda: 0,
                 due: Callable[[float], int] = lambda horizon: 0):
        self.engine, self.window_s, self.max_batch = engine, float(window_s), int(max_batch)
        self.live, self.due = live, due
        self._queue: "queue.Queue[Optional[Request]]" = queue.Queue()
        self._spec: Optional[SamplingSpec] = None
        self._calls = 0
        self.failure: Optional[BaseException] = None  # the engine thread was interrupted: nothing is served
        self.request_errors = 0  # requests the engine raised on (each sampled alone)
        self.first_error = ""  # the first of them, for the job's log
        self.step_served = self.step_failed = 0  # requests of this step served / failed by the engine
        self.generate_calls = 0
        self.batched_requests = 0
        self._last_call_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="agent-engine", daemon=True)
        self._thread.start()

    def use(self, spec: SamplingSpec) -> None:
        """The step's sampling (temperature, top_p, top_k, seed); requests set max_tokens and stop."""
        self._spec, self._calls = spec, 0
        self.step_served = self.step_failed = 0

    @property
    def default_stop(self) -> Tuple[str, ...]:
        """The job's stop strings (rollout.stop): a request that names none stops at these."""
        return tuple(self._spec.stop) if self._spec is not None else ()

    def submit(self, prompt_ids: List[int], max_tokens: int, stop: Tuple[str, ...]) -> Sampled:
        """Blocks until the request's completion is sampled (called from server threads)."""
        if self.failure is not None:
            raise EngineClosed(f"the rollout engine stopped: {self.failure!r}")
        req = Request(list(prompt_ids), int(max_tokens), tuple(stop))
        self._queue.put(req)
        return req.future.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return self._drain()
            batch, start = [first], time.monotonic()
            gap = max(self.window_s, 0.02 * self._last_call_s)
            patience = max(10 * gap, self._last_call_s)  # for due runs: one call's time at most
            stop = False
            while len(batch) < min(self.max_batch, self.live() or self.max_batch):
                now = time.monotonic()
                patient = now < start + patience and self.due(self._last_call_s) > 0
                if patient:  # re-asked every gap (50 ms at least): a due run may stop being due
                    wait = min(start + patience - now, max(gap, 0.05))
                else:
                    wait = min(gap, start + 10 * gap - now)
                try:
                    nxt = self._queue.get(timeout=max(wait, 0.0))
                except queue.Empty:
                    if patient:
                        continue
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            if not self._serve(batch) or stop:
                return self._drain()

    def _serve(self, batch: List[Request]) -> bool:
        """Serves the batch; False when the engine thread must stop (an interrupt, not an error)."""
        by_stop: dict = {}
        for req in batch:
            by_stop.setdefault(req.stop, []).append(req)
        try:
            for stop, reqs in by_stop.items():
                self._call(reqs, stop)
        except BaseException as e:  # noqa: BLE001 - not an Exception (KeyboardInterrupt): nothing more is served
            self.failure = self.failure or e
            log.error("agent endpoint: the engine thread stopped: %r", e)
            for req in batch:
                if not req.future.done():
                    req.future.set_exception(EngineClosed(f"the rollout engine stopped: {e!r}"))
            return False
        return True

    def _call(self, reqs: List[Request], stop: Tuple[str, ...]) -> None:
        """One generate call for `reqs`; if it raises, each request again alone (one bad request
        must not fail the others), and one that fails alone gets the error."""
        try:
            rows = self._generate(reqs, stop)
        except Exception as e:  # noqa: BLE001 - the requests' error, never the batcher's
            if len(reqs) > 1:
                for req in reqs:
                    self._call([req], stop)
                return
            self._failed(reqs[0], e)
            return
        self.step_served += len(reqs)
        for req, row in zip(reqs, rows):
            req.future.set_result(row)

    def _failed(self, req: Request, e: Exception) -> None:
        if isinstance(e, EngineClosed):  # no step is running: not the engine's doing
            req.future.set_exception(e)
            return
        self.request_errors += 1
        self.step_failed += 1
        text = f"{type(e).__name__}: {e}"
        if not self.first_error:
            self.first_error = text
            log.error("agent endpoint: the rollout engine raised on a request (%d prompt tokens); that request "
                      "gets an error, the others are served; further ones are only counted: %s",
                      len(req.prompt_ids), text)
        refused = isinstance(e, ValueError)
        req.future.set_exception(EngineRequestError(
            f"the rollout engine {'refused' if refused else 'failed on'} this request: {text}", refused))

    def _generate(self, reqs: List[Request], stop: Tuple[str, ...]) -> List[Sampled]:
        if self._spec is None:
            raise EngineClosed("no step is running")
        most = max(r.max_tokens for r in reqs)
        spec = dataclasses.replace(self._spec, n=1, max_tokens=most, stop=stop,
                                   seed=request_seed(self._spec.seed, "agent-call", self._calls) % 2**31)
        self._calls += 1
        t0 = time.monotonic()
        out = self.engine.generate_local([r.prompt_ids for r in reqs], spec)
        self._last_call_s = time.monotonic() - t0
        self.generate_calls += 1
        self.batched_requests += len(reqs)
        rows = []
        for k, req in enumerate(reqs):
            ids, lps, finish = out.response_ids[k], out.logprobs[k], out.finish_reason[k]
            if len(ids) > req.max_tokens:
                ids, lps, finish = ids[:req.max_tokens], lps[:req.max_tokens], "length"
            rows.append(Sampled(list(ids), [float(x) for x in lps], finish))
        return rows

    def _drain(self) -> None:
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return
            if req is not None:
                req.future.set_exception(EngineClosed("the agent endpoint is shutting down"))
