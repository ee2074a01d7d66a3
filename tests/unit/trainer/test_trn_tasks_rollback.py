"""data.tasks sampling, the task-weight scheduler and the rollback guard's rules: pure Python."""
import json
import math

import pytest
import torch

from verl_hpc.data.errors import DataError
from verl_hpc.data.tasks import TaskSampler
from verl_hpc.trainer.hooks.rollback_rules import RollbackRules
from verl_hpc.trainer.hooks.task_weights import TaskWeightScheduler, task_metrics

GROUPS = {"easy": list(range(0, 10)), "hard": list(range(10, 40))}


def which(i):
    return "easy" if i < 10 else "hard"


def test_task_sampler_shares_follow_weights_and_change_at_once():
    s = TaskSampler(GROUPS, {"easy": 1.0, "hard": 3.0}, seed=7)
    first = [which(i) for i in s.next_indices(40)]
    assert first.count("easy") == 10 and first.count("hard") == 30
    for n in range(1, 41):  # within one sample of the exact share at every prefix
        assert abs(first[:n].count("easy") - n / 4) <= 1
    s.set_weights({"easy": 3.0, "hard": 1.0})  # no deficit to pay back: the new shares apply now
    nxt = [which(i) for i in s.next_indices(8)]
    assert abs(nxt.count("easy") - 6) <= 1, nxt
    with pytest.raises(DataError, match="positive sum"):
        s.set_weights({"easy": 0.0, "hard": 0.0})


def test_task_sampler_state_round_trips_through_json_exactly():
    a = TaskSampler(GROUPS, {"easy": 0.3, "hard": 0.7}, seed=1)
    a.next_indices(13)
    a.set_weights({"easy": 0.11, "hard": 0.89})
    a.next_indices(5)
    b = TaskSampler(GROUPS, {"easy": 1.0, "hard": 1.0}, seed=1)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert a.next_indices(50) == b.next_indices(50)
    with pytest.raises(DataError, match="same tasks"):
        TaskSampler({"x": [0]}, {"x": 1.0}).load_state_dict(a.state_dict())


def test_task_metrics_per_task():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    lengths = torch.tensor([2, 4, 6, 8])
    m = task_metrics(scores, lengths, [{"task": "a"}, {"task": "a"}, {"task": "b"}, {"task": "b"}])
    assert m["task/a/reward"] == 0.5 and m["task/a/acc"] == 0.5 and m["task/a/response_length"] == 3.0
    assert m["task/b/acc"] == 1.0 and m["task/a/share"] == 0.5
    assert task_metrics(scores, lengths, [{}] * 4) == {}


def sched(**kw):
    args = dict(schedule="plateau", metric="reward", patience=2, min_delta=0.01, saturation=0.9, decay=0.5,
                min_weight=0.25)
    args.update(kw)
    return TaskWeightScheduler({"easy": 1.0, "hard": 1.0}, **args)


def test_scheduler_lowers_the_saturated_task_after_patience_and_gives_its_share_to_the_laggard():
    s = sched()
    s.observe(1, {"task/easy/reward": 0.95, "task/hard/reward": 0.1})
    assert s.weights == {"easy": 1.0, "hard": 1.0}  # patience 2: one observation is not enough
    s.observe(2, {"task/easy/reward": 0.95, "task/hard/reward": 0.2})
    assert s.weights == {"easy": 0.5, "hard": 1.5}
    for step in range(3, 9):  # easy stays saturated; hard keeps improving
        m = s.observe(step, {"task/easy/reward": 0.96, "task/hard/reward": 0.2 + 0.05 * step})
    assert s.weights["easy"] == 0.25 and s.weights["hard"] == 1.75  # never below min_weight
    assert m["task/easy/weight"] == 0.25 and m["task/weight_changes"] == 2.0
    assert math.isclose(sum(s.weights.values()), 2.0)


def test_scheduler_plateau_fixed_all_stale_and_missing_metric():
    s = sched()
    for step in range(1, 5):  # hard stops improving, easy improves: hard is lowered
        s.observe(step, {"task/easy/reward": 0.1 * step, "task/hard/reward": 0.3})
    assert s.weights["hard"] < 1.0 < s.weights["easy"]
    s = sched()
    for step in range(1, 8):  # hard is stuck at 0 (stale) but easy is saturated: it takes no share
        s.observe(step, {"task/easy/reward": 1.0, "task/hard/reward": 0.0})
    assert s.weights == {"easy": 0.25, "hard": 1.75}
    s = sched(saturation=2.0)
    for step in range(1, 30):  # easy improves, then plateaus; hard is stuck: no back and forth
        s.observe(step, {"task/easy/reward": min(0.1 * step, 0.8), "task/hard/reward": 0.0})
        if step == 4:
            assert s.weights == {"easy": 1.5, "hard": 0.5}  # hard plateaued while easy improved
    assert s.weights == {"easy": 1.75, "hard": 0.25} and s.changes == 2
    s = sched()
    for step in range(1, 6):  # both stale: nobody to give the share to, nothing changes
        s.observe(step, {"task/easy/reward": 0.3, "task/hard/reward": 0.3})
    assert s.weights == {"easy": 1.0, "hard": 1.0}
    s = sched(metric="val_acc")
    for step in range(1, 6):  # the watched metric is absent (no validation this step): no observation
        s.observe(step, {"task/easy/reward": 1.0, "task/hard/reward": 0.0})
    assert s.waited == {"easy": 0, "hard": 0}
    f = sched(schedule="fixed")
    f.observe(1, {"task/easy/reward": 1.0})
    assert f.weights == {"easy": 1.0, "hard": 1.0}


def test_scheduler_state_round_trips():
    s = sched()
    for step in range(1, 4):
        s.observe(step, {"task/easy/reward": 0.95, "task/hard/reward": 0.1 * step})
    t = sched()
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.state_dict() == s.state_dict()


def rules(**kw):
    args = dict(metrics=["r"], drop=0.5, baseline="best", window=3, drop_floor=0.05, warmup_steps=1,
                kl_metric="kl", kl_max=0.0, entropy_metric="ent", entropy_min=0.0)
    args.update(kw)
    return RollbackRules(**args)


def test_rules_drop_vs_best_and_window():
    r = rules()
    assert r.check(1, {"r": 0.8}) is None and r.check(2, {"r": 0.5}) is None  # 0.3 < 0.5 * 0.8
    trip = r.check(3, {"r": 0.3})
    assert trip.rule == "drop" and trip.metric == "r" and trip.reference == 0.8
    assert "r dropped at step 3" in trip.message
    assert r.best["r"] == 0.8 and r.seen["r"] == 2  # the tripping step entered no baseline
    w = rules(baseline="window", window=2)
    b = rules()
    for step, v in enumerate([1.0, 0.6, 0.45, 0.3], 1):  # a slide: never half the last 2 steps' mean
        assert w.check(step, {"r": v}) is None
        trip = b.check(step, {"r": v})
    assert trip.rule == "drop" and trip.reference == 1.0  # but 0.3 is less than half the best
    w.forget_after(3)
    assert list(w.recent["r"]) == [(3, 0.45)]
    z = rules()  # a baseline near 0 counts as drop_floor: 0 -> -1 trips, 0 -> -0.01 does not
    z.check(1, {"r": 0.0})
    assert z.check(2, {"r": -0.01}) is None and z.check(3, {"r": -1.0}).rule == "drop"
    assert rules(warmup_steps=3).check(1, {"r": 1.0}) is None


def test_rules_nonfinite_kl_entropy_and_state():
    assert rules().check(1, {"r": float("nan")}).rule == "nonfinite"
    assert rules(kl_max=0.1).check(1, {"kl": 0.2}).rule == "kl"
    assert rules(kl_max=0.1).check(1, {"kl": 0.05}) is None
    assert rules(entropy_min=0.5).check(1, {"ent": 0.1}).rule == "entropy"
    assert rules().check(1, {"kl": 99.0, "ent": 0.0}) is None  # those rules are off at 0
    r = rules(baseline="window")
    r.check(1, {"r": 1.0})
    r.check(2, {"r": 0.9})
    q = rules(baseline="window")
    q.load_state_dict(json.loads(json.dumps(r.state_dict())))
    assert q.state_dict() == r.state_dict() and q.check(3, {"r": 0.1}).rule == "drop"
