"""TimedCaller.call_each: a batch of reward calls on one worker, each with its own time limit."""
import threading
import time

import pytest

from verl_hpc.rewards.timeout import FunctionExited, RewardTimeout, TimedCaller


def test_the_limit_is_per_call_not_per_batch():
    caller = TimedCaller(timeout_s=2.0)
    t = time.monotonic()
    out = caller.call_each([(time.sleep, (0.6,)), (time.sleep, (0.6,)), (lambda: 7, ())])
    assert out == [(True, None), (True, None), (True, 7)]  # 1.2 s in all: over the limit, each under it
    assert time.monotonic() - t >= 1.2 and caller.abandoned == 0


def test_a_hung_call_times_out_and_the_rest_run_once_on_a_fresh_worker():
    release, ran = threading.Event(), []

    def call(k):
        ran.append(k)
        if k == 1:
            release.wait()
        return k * 10

    caller = TimedCaller(timeout_s=0.3)
    try:
        out = caller.call_each([(call, (k,)) for k in range(4)])
        assert [ok for ok, _ in out] == [True, False, True, True]
        assert isinstance(out[1][1], RewardTimeout) and [v for _, v in out[2:]] == [20, 30]
        assert caller.abandoned == 1
    finally:
        release.set()
    time.sleep(0.2)  # the abandoned worker returns from call 1: it must not run 2 and 3 again
    assert sorted(ran) == [0, 1, 2, 3]


def test_exceptions_come_back_per_call_as_call_would_raise_them():
    def boom():
        raise ValueError("bad row")

    def leave():
        raise SystemExit(3)

    for timeout in (0.0, 5.0):  # inline (no limit) and on the worker
        out = TimedCaller(timeout).call_each([(boom, ()), (leave, ()), (lambda: 1.5, ())])
        assert isinstance(out[0][1], ValueError) and not out[0][0]
        assert isinstance(out[1][1], FunctionExited) and not out[1][0]
        assert out[2] == (True, 1.5)
        with pytest.raises(ValueError, match="bad row"):
            TimedCaller(timeout)(boom)


def test_stop_at_failure_starts_nothing_after_the_first_failure():
    """reward.on_error=raise: a hung (or raising) call ends the batch; the calls queued behind it
    never run, so a reward function that hangs on every sample costs one timeout, not one each."""
    release, ran = threading.Event(), []

    def call(k):
        ran.append(k)
        if k == 1:
            release.wait()
        if k == 2:
            raise ValueError("row 2")
        return k

    try:
        out = TimedCaller(timeout_s=0.3).call_each([(call, (k,)) for k in range(4)], stop_at_failure=True)
        assert [ok for ok, _ in out] == [True, False] and isinstance(out[1][1], RewardTimeout)
    finally:
        release.set()
    time.sleep(0.2)
    assert ran == [0, 1]
    for timeout in (0.0, 5.0):
        ran.clear()
        out = TimedCaller(timeout).call_each([(call, (k,)) for k in (0, 2, 3)], stop_at_failure=True)
        assert [ok for ok, _ in out] == [True, False] and isinstance(out[1][1], ValueError)
        time.sleep(0.1)
        assert ran == [0, 2]
