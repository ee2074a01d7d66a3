"""The batcher: concurrent requests become few generate calls, each request keeps its own limit,
and an engine failure reaches every waiting request and the runner, not an agent."""
import threading

import pytest

from verl_hpc.rollout.agents.batcher import Batcher, EngineClosed
from verl_hpc.rollout.result import ShardOutput
from verl_hpc.rollout.spec import default_spec


class FakeEngine:
    """Samples token k+100 at position k for every prompt; records each call's prompts and spec."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def generate_local(self, prompts, spec):
        self.calls.append(([list(p) for p in prompts], spec))
        if self.fail:
            raise RuntimeError("engine broke")
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


def test_an_engine_failure_reaches_the_waiting_requests_and_is_kept_for_the_runner():
    b = Batcher(FakeEngine(fail=True), window_s=0.0, max_batch=4, live=lambda: 2)
    b.use(default_spec(max_tokens=2))
    out = submit_all(b, [([1], 1, ()), ([2], 1, ())])
    assert all(isinstance(e, EngineClosed) and "engine broke" in str(e) for e in out)
    assert isinstance(b.failure, RuntimeError)
    with pytest.raises(EngineClosed, match="the rollout engine failed"):
        b.submit([3], 1, ())
    b.close()
