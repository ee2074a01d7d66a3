"""Two elastic workers under one name (the same Slurm job): the run refuses the second by the
number of its join, and the first, healthy, stays in the pool (issue 67 item 6). A worker that
comes back under its name (a Slurm requeue: its job id, a higher SLURM_RESTART_COUNT; or a new
start after it left) is a new member under its new join's keys, whatever the old member left in the
store; a requeue replaces its old run still in the pool; a stale restart is refused (issue 76
item 6)."""
import threading

import pytest
import torch.distributed as dist

from verl_hpc.config import load_config
from verl_hpc.runtime.split import Mailbox
from verl_hpc.trainer.placement.elastic.channel import left_key
from verl_hpc.trainer.placement.elastic.coordinator import LEAVE, Coordinator
from verl_hpc.trainer.placement.elastic.rendezvous import ElasticJoinError
from verl_hpc.trainer.placement.elastic.worker import Worker, restart_count
from verl_hpc.trainer.placement.inflight import InFlight

RUN = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2", "placement.mode=split",
       "placement.elastic.enable=true"]


def worker(store, name: str, epoch: int = 0, restart: int = 0) -> Worker:
    """A worker with its store and name (no run folder, no engine: the join alone)."""
    w = Worker.__new__(Worker)
    w.run_dir, w.name, w.epoch, w.signalled, w.restart = "/runs/r", name, epoch, None, restart
    w.mail = Mailbox(store, f"elastic rollout worker {name}", 10.0)
    return w


def join_in_thread(w):
    out = {}

    def go():
        try:
            w.join_pool()
            out["ok"] = True
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            out["error"] = e

    t = threading.Thread(target=go)
    t.start()
    return t, out


def serve_until(coord, t):
    while t.is_alive():
        coord.service()
        t.join(0.02)


def test_a_second_worker_of_the_same_name_is_refused_and_the_first_stays():
    store = dist.HashStore()
    cfg = load_config(None, RUN)
    clock = [0.0]
    coord = Coordinator(cfg, Mailbox(store, "rollout rank 0", 10.0), epoch=0, clock=lambda: clock[0])
    first, second = worker(store, "4242"), worker(store, "4242")
    t, out = join_in_thread(first)
    serve_until(coord, t)
    assert out == {"ok": True} and set(coord.pool.members) == {"4242"}
    t, out = join_in_thread(second)
    serve_until(coord, t)
    err = out["error"]
    assert isinstance(err, ElasticJoinError) and err.exit_code == 30 and "\n" not in str(err)
    assert "refused it: a worker named '4242' is in the pool" in str(err)
    # the first is untouched: still a member, nothing tells it to leave, its heartbeat still counts
    first._check_run()
    store.add(f"elastic/beat/{first.member}", 1)
    clock[0] += 0.5
    coord.service()
    assert "4242" in coord.pool.members and coord.counters["joins"] == 1 and coord.counters["leaves"] == 0
    # a worker of another name joins as usual
    t, out = join_in_thread(worker(store, "4243"))
    serve_until(coord, t)
    assert out == {"ok": True} and {"4242", "4243"} <= set(coord.pool.members)


def test_a_worker_of_another_epoch_is_refused_by_its_join():
    store = dist.HashStore()
    coord = Coordinator(load_config(None, RUN), Mailbox(store, "rollout rank 0", 10.0), epoch=3)
    t, out = join_in_thread(worker(store, "7", epoch=2))
    serve_until(coord, t)
    assert "another epoch of the run (2; the run is in 3)" in str(out["error"])
    assert len(coord.pool) == 0


def run_with_work(store, clock):
    """A coordinator with one batch open (2 prompts, 2 samples each) for the workers to lease."""
    cfg = load_config(None, RUN + ["placement.elastic.groups_per_lease=2"])
    coord = Coordinator(cfg, Mailbox(store, "rollout rank 0", 10.0), epoch=0, clock=lambda: clock[0])
    coord.open(InFlight.start(1, None, [[5, 6], [7, 8]], 0, n=2))
    return coord


def joined(coord, w):
    t, out = join_in_thread(w)
    serve_until(coord, t)
    return out


def ask(coord, w, n):
    """Worker w's request n for work, as worker.py posts it; the run's answer."""
    w.mail.put(f"elastic/want/{w.member}/{n}", dict(version=0, groups=2))
    coord.service()
    return w.mail.take(f"elastic/lease/{w.member}/{n}")


def test_a_worker_that_left_joins_again_under_its_name_as_a_new_member():
    store, clock = dist.HashStore(), [0.0]
    coord = run_with_work(store, clock)
    old = worker(store, "4242")
    assert joined(coord, old) == {"ok": True} and old.member == "4242/0"
    assert len(ask(coord, old, 0)) == 2  # it holds both groups
    old.mail.put(f"elastic/want/{old.member}/1", dict(version=0, groups=2))  # a request it never saw answered
    old.mail.put(f"elastic/bye/{old.member}", "stopped by SIGTERM (scancel or preemption)")
    coord.service()
    assert "4242" not in coord.pool.members and store.check([left_key("4242/0")])  # the weight server forgets it
    assert coord.ledger.stats["returned"] == 4
    # the same job started again: taken, under keys of its own join; the old member's leftovers
    # (its unanswered request, answered LEAVE) never reach it
    again = worker(store, "4242")
    assert joined(coord, again) == {"ok": True} and again.member == "4242/1"
    assert set(coord.pool.members) == {"4242"} and coord.counters["joins"] == 2
    assert old.mail.take("elastic/lease/4242/0/1") == LEAVE
    leases = ask(coord, again, 0)
    assert sorted((p["prompt"], p["samples"]) for p in leases) == [(0, (0, 1)), (1, (0, 1))]
    store.add(f"elastic/beat/{again.member}", 1)
    clock[0] += 30.0  # its heartbeat counts: within the 60 s default
    coord.service()
    assert "4242" in coord.pool.members
    assert [e.kind for e in coord.pool.events] == ["join", "leave", "join"]


def test_a_requeued_worker_replaces_its_old_run_still_in_the_pool():
    """Slurm requeued the job (its node failed): the new run comes back under the job's id with
    SLURM_RESTART_COUNT 1 before the old run's silence was noticed. The old member leaves, its
    groups go back to the queue, and the new one takes them."""
    store, clock = dist.HashStore(), [0.0]
    coord = run_with_work(store, clock)
    old = worker(store, "900_3")
    assert joined(coord, old) == {"ok": True}
    assert len(ask(coord, old, 0)) == 2
    requeued = worker(store, "900_3", restart=1)
    assert joined(coord, requeued) == {"ok": True} and requeued.member != old.member
    leave = coord.pool.events[-2]
    assert (leave.kind, leave.worker, leave.reason) == ("leave", "900_3", "replaced by its requeue (restart 1)")
    assert coord.ledger.stats["returned"] == 4 and store.check([left_key(old.member)])
    assert len(ask(coord, requeued, 0)) == 2  # the old run's groups, leased again
    assert ask(coord, old, 1) == LEAVE  # the old run, if it still speaks, is told to leave
    # a stale run of the job (an older restart) is refused; the requeued member stays
    t, out = join_in_thread(worker(store, "900_3", restart=0))
    serve_until(coord, t)
    assert "refused it: it is restart 0 of '900_3', whose restart 1 has already joined" in str(out["error"])
    # a second worker inside the requeued job (the same restart) is refused as before
    t, out = join_in_thread(worker(store, "900_3", restart=1))
    serve_until(coord, t)
    assert "a worker named '900_3' is in the pool" in str(out["error"])
    assert coord.restarts == {"900_3": 1} and coord.keys["900_3"] == requeued.member


def test_a_reaped_worker_requeued_joins_again():
    store, clock = dist.HashStore(), [0.0]
    coord = run_with_work(store, clock)
    old = worker(store, "77")
    assert joined(coord, old) == {"ok": True}
    clock[0] += 61.0  # silent past the heartbeat timeout: reaped
    coord.service()
    assert coord.counters["reaped"] == 1 and "77" not in coord.pool.members
    assert joined(coord, worker(store, "77", restart=1)) == {"ok": True} and "77" in coord.pool.members


@pytest.mark.parametrize("value, want", [("", 0), ("0", 0), ("3", 3)])
def test_the_restart_count_comes_from_slurm(monkeypatch, value, want):
    monkeypatch.setenv("SLURM_RESTART_COUNT", value)
    assert restart_count() == want


def test_a_bad_restart_count_is_one_line(monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "-1")
    with pytest.raises(ElasticJoinError, match=r"SLURM_RESTART_COUNT = '-1': expected a whole number >= 0"):
        restart_count()
