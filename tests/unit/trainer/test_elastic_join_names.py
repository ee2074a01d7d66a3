"""Two elastic workers under one name (the same Slurm job): the run refuses the second by the
number of its join, and the first, healthy, stays in the pool (issue 67 item 6)."""
import threading

import pytest
import torch.distributed as dist

from verl_hpc.config import load_config
from verl_hpc.runtime.split import Mailbox
from verl_hpc.trainer.placement.elastic.coordinator import Coordinator
from verl_hpc.trainer.placement.elastic.rendezvous import ElasticJoinError
from verl_hpc.trainer.placement.elastic.worker import Worker

RUN = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2", "placement.mode=split",
       "placement.elastic.enable=true"]


def worker(store, name: str, epoch: int = 0) -> Worker:
    """A worker with its store and name (no run folder, no engine: the join alone)."""
    w = Worker.__new__(Worker)
    w.run_dir, w.name, w.epoch, w.signalled = "/runs/r", name, epoch, None
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
    store.add("elastic/beat/4242", 1)
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
