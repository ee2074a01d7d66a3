"""The elastic rollout pool's book (trainer/placement/elastic/ledger.py) and membership (pool.py):
exactly once whatever joins, leaves or straggles; the staleness rule on leases; prefixes kept or
dropped; a checkpoint of the book; the indexed book answers every call as a plain-scan copy of its
rules; heartbeats, reasons and the minimum-pool rule."""
import collections
import random

import pytest

from elastic_naive_ledger import NaiveLedger
from verl_hpc.trainer.placement.elastic.ledger import Ledger
from verl_hpc.trainer.placement.elastic.pool import Pool, PoolLostError
from verl_hpc.trainer.placement.inflight import Sample


def sample(step, i, j, worker="", length=3):
    """A sample whose tokens name what it is (step, prompt, sample) and who made it."""
    return Sample(tokens=[step, i, j] + [0] * (length - 3), logprobs=[-1.0] * length, versions=[0] * length,
                  finish="stop" + (f":{worker}" if worker else ""))


def finish(ledger, lease, worker=None, only=None):
    return ledger.complete(lease.id, {j: sample(lease.step, lease.prompt, j, worker or lease.worker)
                                      for j in lease.samples if only is None or j in only})


def test_every_sample_once_in_step_order():
    ledger = Ledger(staleness=1, deadline_s=100)
    for step in (1, 2):
        ledger.want(step, prompts=3, n=2)
    leases = ledger.lease("a", version=0, now=0, max_groups=10)
    # version 0 may start batch 1 (0 >= 1 - 1 - 1) and batch 2 (0 >= 2 - 1 - 1), not more
    assert [(x.step, x.prompt, x.samples) for x in leases] == [(s, i, (0, 1)) for s in (1, 2) for i in range(3)]
    assert ledger.lease("b", version=0, now=1, max_groups=10) == []  # all held, within the deadline
    for lease in reversed(leases):  # finished out of order
        finish(ledger, lease)
        if lease.step == 2 and lease.prompt == 0:
            assert ledger.ready() == [], "batch 2 waits for batch 1"
    ready = ledger.ready()
    assert [s for s, _ in ready] == [1, 2]
    assert all(rows[i][j].tokens == [s, i, j] for s, rows in ready for i in range(3) for j in range(2))
    assert ledger.per_worker == {"a": 12} and ledger.oldest_open() is None


def test_the_staleness_rule_holds_back_batches_the_weights_may_not_start():
    ledger = Ledger(staleness=0, deadline_s=100)
    for step in (1, 2, 3):
        ledger.want(step, prompts=1, n=1)
    assert [x.step for x in ledger.lease("a", version=0, now=0, max_groups=5)] == [1]  # 0 >= s - 1
    assert [x.step for x in ledger.lease("b", version=2, now=0, max_groups=5)] == [2, 3]


def test_a_worker_that_leaves_gives_back_only_what_it_had_not_finished():
    ledger = Ledger(staleness=0, deadline_s=100)
    ledger.want(1, prompts=2, n=3)
    a = ledger.lease("a", version=0, now=0, max_groups=2)
    finish(ledger, a[0], only={0})  # one sample of prompt 0 done: the lease closes, 1 and 2 are free again
    assert ledger.leave("a") == 3  # prompt 1's three samples
    again = ledger.lease("b", version=0, now=1, max_groups=5)
    assert sorted((x.prompt, x.samples) for x in again) == [(0, (1, 2)), (1, (0, 1, 2))]
    for lease in again:
        finish(ledger, lease)
    (step, rows), = ledger.ready()
    assert [[s.finish for s in row] for row in rows] == [["stop:a", "stop:b", "stop:b"], ["stop:b"] * 3]
    assert ledger.stats["returned"] == 3 and ledger.stats["redispatched"] == 0


def test_a_straggler_is_redispatched_after_its_deadline_and_the_first_copy_wins():
    ledger = Ledger(staleness=0, deadline_s=10)
    ledger.want(1, prompts=1, n=4)
    slow, = ledger.lease("slow", version=0, now=0)
    assert ledger.lease("fast", version=0, now=9) == []  # within the deadline: nothing to take
    assert ledger.lease("slow", version=0, now=11) == [], "a straggler is not handed its own samples"
    fast, = ledger.lease("fast", version=0, now=11)
    assert fast.samples == (0, 1, 2, 3) and ledger.stats["redispatched"] == 4
    assert finish(ledger, fast, only={0, 1, 2}) == [0, 1, 2]
    assert finish(ledger, slow) == [3]  # the slow worker's copies of 0-2 are dropped, its 3 kept
    assert ledger.stats["duplicates"] == 3
    (_, rows), = ledger.ready()
    assert [s.finish for s in rows[0]] == ["stop:fast"] * 3 + ["stop:slow"]


def test_prefixes_are_continued_or_dropped():
    for keep in (True, False):
        ledger = Ledger(staleness=0, deadline_s=100, keep_prefixes=keep)
        ledger.want(1, prompts=1, n=2)
        a, = ledger.lease("a", version=0, now=0)
        ledger.progress(a.id, 1, Sample([7, 8], [-0.5, -0.5], [0, 0]))
        ledger.leave("a")
        b, = ledger.lease("b", version=0, now=1)
        assert (1 in b.prefixes and b.prefixes[1].tokens == [7, 8]) is keep and 0 not in b.prefixes


def test_a_lease_of_a_run_before_a_restart_is_refused():
    ledger = Ledger(staleness=0, deadline_s=100)
    ledger.want(1, prompts=1, n=1)
    ledger.lease("a", version=0, now=0)
    assert ledger.complete(999, {0: sample(1, 0, 0)}) == [] and ledger.stats["unknown_lease"] == 1


def test_the_book_resumes_from_its_state_and_open_leases_are_free_again():
    ledger = Ledger(staleness=0, deadline_s=100)
    ledger.want(1, prompts=2, n=2)
    first, second = ledger.lease("a", version=0, now=0, max_groups=2)
    finish(ledger, first)
    ledger.progress(second.id, 0, Sample([5], [-1.0], [0]))
    resumed = Ledger(staleness=0, deadline_s=100)
    resumed.load_state_dict(ledger.state_dict())
    lease, = resumed.lease("b", version=0, now=0, max_groups=5)
    assert (lease.prompt, lease.samples, lease.prefixes[0].tokens) == (1, (0, 1), [5])
    finish(resumed, lease)
    (_, rows), = resumed.ready()
    assert [[s.finish for s in row] for row in rows] == [["stop:a"] * 2, ["stop:b"] * 2]


def test_nothing_lost_nothing_twice_under_random_churn():
    """Workers join, finish, straggle, leave and die at random over 6 batches; every wanted sample
    reaches training exactly once, and each is the sample of its own (step, prompt, sample) key."""
    rng = random.Random(0)
    ledger = Ledger(staleness=1, deadline_s=5)
    steps, prompts, n = range(1, 7), 4, 3
    for s in steps:
        ledger.want(s, prompts, n)
    workers, held, got, version, t = ["w0"], {}, [], 0, 0.0
    while len(got) < len(steps):
        t += 1
        if rng.random() < 0.2:
            workers.append(f"w{len(workers) + len(got) + int(t)}")
        if len(workers) > 1 and rng.random() < 0.15:
            gone = workers.pop(rng.randrange(len(workers)))
            if rng.random() < 0.5:  # a goodbye; else it just goes silent (its leases age out)
                ledger.leave(gone)
            held.pop(gone, None)
        for w in workers:
            if w not in held:
                held[w] = ledger.lease(w, version, t, max_groups=2)
            elif rng.random() < 0.6:  # finishes its leases, some of it
                for lease in held.pop(w):
                    finish(ledger, lease, only=None if rng.random() < 0.8 else set(lease.samples[:1]))
        for s, rows in ledger.ready():
            got.append(s)
            version = s  # the trainer's step s makes weights version s
            assert all(rows[i][j].tokens == [s, i, j] for i in range(prompts) for j in range(n))
    assert got == list(steps)


def _lease_view(leases):
    return [(x.id, x.worker, x.step, x.prompt, x.samples, x.version, x.deadline,
             {j: len(p.tokens) for j, p in x.prefixes.items()}) for x in leases]


@pytest.mark.parametrize("keep", [True, False])
def test_the_indexed_book_answers_every_call_as_a_plain_scan(keep):
    """Random wants, leases (any version, so the staleness rule bites), progress, completions of
    some samples, goodbyes and ready() over a clock that lets deadlines pass: the Ledger and the
    naive copy of its rules give the same answers, counters and prefixes, call for call; and the
    trace reaches re-dispatch, duplicates and hand-backs, and a resume from the state mid-trace."""
    rng = random.Random(7)
    books = [Ledger(1, 3.0, keep_prefixes=keep), NaiveLedger(1, 3.0, keep_prefixes=keep)]
    now, wanted, workers = 0.0, 0, [f"w{i}" for i in range(5)]
    answers = collections.Counter()
    for call in range(1500):
        now += rng.uniform(0, 0.6)
        op = rng.random()
        if call == 750:
            # a checkpoint and resume: the resumed book has no open leases (the workers left with
            # the stopped run), which the plain book gets by every worker leaving; those goodbyes'
            # hand-back count is not the resumed book's. Lease ids go on from the same counter so
            # that the two books' answers stay comparable.
            resumed = Ledger(1, 3.0, keep_prefixes=keep)
            resumed.load_state_dict(books[0].state_dict())
            resumed._ids = books[0]._ids
            for worker in workers:
                books[1].leave(worker)
            books[1].stats = dict(resumed.stats)
            books[0] = resumed
        if op < 0.05 or wanted < 2:
            wanted += 1
            prompts = rng.choice([1, 3]) if wanted % 4 else 2
            for b in books:
                b.want(wanted, prompts, 3)
            continue
        if op < 0.5:
            args = (rng.choice(workers), rng.randint(0, wanted), now, rng.randint(1, 3))
            got = [_lease_view(b.lease(*args)) for b in books]
            answers["leases"] += len(got[0])
        elif op < 0.8 and books[1].open:
            lease = books[1].open[rng.choice(sorted(books[1].open))]
            if rng.random() < 0.3:
                j = rng.choice(lease.samples)
                prefix = Sample(list(range(rng.randint(1, 40))), [-1.0], [lease.version])
                got = [b.progress(lease.id, j, prefix) for b in books]
            else:
                done = {j: sample(lease.step, lease.prompt, j) for j in lease.samples if rng.random() < 0.7}
                got = [b.complete(lease.id, done) for b in books]
        elif op < 0.88:
            worker = rng.choice(workers)
            got = [b.leave(worker) for b in books]
        else:
            got = [b.ready() for b in books]
            answers["batches"] += len(got[0])
        assert got[0] == got[1], f"call {call}"
        assert books[0].stats == books[1].stats and books[0].per_worker == books[1].per_worker
        assert {k: len(v.tokens) for k, v in books[0].prefix.items()} == \
            {k: len(v.tokens) for k, v in books[1].prefix.items()}
    assert answers["leases"] > 300 and answers["batches"] > 5
    assert min(books[0].stats[k] for k in ("redispatched", "duplicates", "returned")) > 0


def test_pool_joins_heartbeats_leaves_and_the_minimum():
    pool = Pool(min_workers=2, heartbeat_timeout_s=30, lost_timeout_s=100)
    pool.join("w1", 0, job="101_1", node="n1")
    pool.join("w2", 5, job="101_2", node="n2")
    assert not pool.waiting() and pool.beat("w1", 20)
    assert pool.reap(40) == ["w2"]  # silent since 5 (> 30 s); w1 beat at 20
    assert pool.waiting()
    pool.check(140)  # short since 40: 100 s, not more
    pool.leave("w1", 150, "preempted (SIGTERM)")
    assert not pool.beat("w1", 151), "a worker that left is told so"
    with pytest.raises(PoolLostError) as e:
        pool.check(141 + 100)
    text = str(e.value)
    assert "fewer than placement.elastic.min_rollout_workers = 2" in text and "lost_timeout_s = 100" in text and "w2 at 40 s: no heartbeat for 35 s" in text
    assert "w1 at 150 s: preempted (SIGTERM)" in text and "\n" not in text
    assert pool.sizes() == [(0, 1), (5, 2), (40, 1), (150, 0)]
    pool.join("w3", 250)
    pool.join("w4", 251)
    pool.check(1000)  # back at the minimum: the clock restarts
    assert [e.kind for e in pool.events] == ["join", "join", "leave", "leave", "join", "join"]
