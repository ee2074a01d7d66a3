"""The batcher: concurrent requests become few generate calls, each request keeps its own limit,
and a generate call that raises fails only the request the engine raised on: the others of its
batch are served, and so is every later request."""
import threading

import pytest

from verl_hpc.rollout.agents.batcher import Batcher, EngineRequestError
from verl_hpc.rollout.result import ShardOutput
from verl_hpc.rollout.sampling import default_spec


class FakeEngine:
    """Samples token k+100 at position k for every prompt; records each call's prompts and spec.
    Raises on any call whose prompts hold a negative id (ValueError, as an engine refusing an
    input) or, with fail=True, on every call (RuntimeError: a broken engine)."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def generate_local(self, prompts, spec):
        self.calls.append(([list(p) for p in prompts], spec))
        if self.fail:
            raise RuntimeError("engine broke")
        if any(t < 0 for p in prompts for t in p):
            raise ValueError("token id out of range")
        n = len(prompts)
        ids = [[100 + k for k in range(spec.max_tokens)] for _ in prompts]
        return ShardOutput(list(range(n)), [0] * n, ids, [[-1.0] * spec.max_tokens for _ in prompts], ["length"] * n)


def submit_all(batcher, requests):
    out = [None] * len(requests)

    def one(k, req):
        try:
            out[k] = batcher.submit(*req)
        except Exception as e:  # noqa: BLE001
            out[k] = e

    threads = [threading.Thread(target=one, args=(k, r)) for k, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_requests_of_all_live_runs_go_into_one_call_per_stop_set_and_keep_their_own_limits():
    engine = FakeEngine()
    b = Batcher(engine, window_s=5.0, max_batch=64, live=lambda: 6)  # a long window: closed by live()
    b.use(default_spec(max_tokens=8))
    reqs = [([1, k], 2 + k % 3, ()) for k in range(4)] + [([9, k], 5, ("x",)) for k in range(2)]
    out = submit_all(b, reqs)
    b.close()
    assert len(engine.calls) == 2  # one per stop set, without waiting out the 5 s window
    for (prompt, limit, stop), got in zip(reqs, out):
        assert got.ids == [100 + k for k in range(limit)] and len(got.logprobs) == limit
    stops = {c[1].stop: (c[1].max_tokens, c[1].n) for c in engine.calls}
    assert stops == {(): (4, 1), ("x",): (5, 1)}  # the most any request of the call asked for
    assert b.generate_calls == 2 and b.batched_requests == 6


def test_calls_get_seeds_of_their_own():
    engine = FakeEngine()
    b = Batcher(engine, window_s=0.0, max_batch=1)
    b.use(default_spec(max_tokens=2, seed=7))
    submit_all(b, [([1], 1, ())])
    submit_all(b, [([1], 1, ())])
    b.close()
    seeds = [c[1].seed for c in engine.calls]
    assert len(set(seeds)) == 2 and 7 not in seeds


@pytest.mark.heavy
def test_a_request_the_engine_raises_on_fails_alone_and_the_batcher_goes_on():
    engine = FakeEngine()
    b = Batcher(engine, window_s=5.0, max_batch=8, live=lambda: 4)
    b.use(default_spec(max_tokens=2))
    out = submit_all(b, [([1], 1, ()), ([5, -3], 1, ()), ([2], 2, ()), ([3], 1, ())])
    assert isinstance(out[1], EngineRequestError) and out[1].refused and "token id out of range" in str(out[1])
    assert [o.ids for k, o in enumerate(out) if k != 1] == [[100], [100, 101], [100]]
    # the batch of four failed, then each was sampled alone: only the bad one failed
    assert [len(c[0]) for c in engine.calls] == [4, 1, 1, 1, 1]
    assert b.request_errors == 1 and b.step_failed == 1 and b.step_served == 3 and b.failure is None
    assert b.submit([4], 1, ()).ids == [100]  # and it serves the next request
    b.use(default_spec(max_tokens=2))  # a new step: its own counts
    assert b.step_failed == b.step_served == 0 and b.request_errors == 1
    b.close()


def test_a_broken_engine_fails_each_request_and_the_step_sees_it_served_nothing():
    b = Batcher(FakeEngine(fail=True), window_s=0.0, max_batch=4, live=lambda: 2)
    b.use(default_spec(max_tokens=2))
    out = submit_all(b, [([1], 1, ()), ([2], 1, ())])
    assert all(isinstance(e, EngineRequestError) and not e.refused and "engine broke" in str(e) for e in out)
    assert b.step_failed == 2 and b.step_served == 0 and b.first_error == "RuntimeError: engine broke"
    b.close()


class SlowEngine(FakeEngine):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def generate_local(self, prompts, spec):
        import time

        time.sleep(self.seconds)
        return super().generate_local(prompts, spec)


def primed(due, *, call_s=0.4):
    """A batcher whose last generate call took `call_s` (its patience for due runs), 3 live runs."""
    engine = SlowEngine(call_s)
    b = Batcher(engine, window_s=0.01, max_batch=64, live=lambda: 3, due=due)
    b.use(default_spec(max_tokens=2))
    submit_all(b, [([0], 1, ())] * 3)
    engine.calls.clear()
    return b, engine


def two_then_one_late(b, late_s=0.25):
    """Two runs ask at once, the third after a silence of late_s (longer than the 10 ms gap, and
    than 10 gaps)."""
    import time

    threads = [threading.Thread(target=b.submit, args=([k], 1, ())) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(late_s)
    b.submit([2], 1, ())
    for t in threads:
        t.join(30)


def test_the_batch_waits_past_the_gap_for_a_run_that_is_due():
    """Lockstep agents come back in a burst after a pause (64 threads share one GIL): a run answered
    less than a call ago, or not yet called, is waited for, and the round stays one call."""
    pending = {"late": 1}
    b, engine = primed(lambda horizon: pending["late"])
    real_submit = b.submit

    def submit(prompt, limit, stop):
        if prompt == [2]:
            pending["late"] = 0
        return real_submit(prompt, limit, stop)

    b.submit = submit
    two_then_one_late(b)
    b.close()
    assert [len(c[0]) for c in engine.calls] == [3]


def test_without_due_runs_a_silence_longer_than_the_gap_closes_the_batch():
    b, engine = primed(lambda horizon: 0)
    two_then_one_late(b)
    b.close()
    assert [len(c[0]) for c in engine.calls] == [2, 1]


def test_a_due_run_that_never_asks_holds_the_batch_one_call_at_most():
    import time

    b, engine = primed(lambda horizon: 1, call_s=0.4)
    t0 = time.monotonic()
    b.submit([7], 1, ())  # the other two never ask, and stay due
    waited = time.monotonic() - t0 - engine.seconds
    b.close()
    assert [len(c[0]) for c in engine.calls] == [1]
    assert 0.35 <= waited < 10, waited  # the last call's time (0.4 s), not forever


def test_a_run_is_due_before_its_first_call_and_for_one_call_after_each_answer():
    import time

    from verl_hpc.rollout.agents.service import Session

    s = Session("k", max_calls=4)
    now = time.monotonic()
    assert s.due(now + 100, 1.0)  # not called yet: due however long it sets itself up
    s.admit()
    assert not s.due(time.monotonic(), 1.0)  # a call in flight: it is in the queue or the batch
    s.answered()
    assert s.due(time.monotonic(), 1.0) and not s.due(time.monotonic() + 2.0, 1.0)
    s.close()
    assert not s.due(time.monotonic(), 1.0)
