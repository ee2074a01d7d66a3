"""Weights to elastic rollout workers: a two-rank group per worker with the first training rank,
which serves them the same snapshot it serves the fixed rollout group (resharding/bridge.py).

    server = ElasticWeightServer(connect, snapshot, timeout_s)   # first training rank; a thread
    server.start(); ... server.close()                           # connect(): a Mailbox of its own
    fetch = WeightFetcher(mailbox, worker_id, timeout_s)         # a worker, another Slurm job
    version, tensors = fetch.newest(after=-1)                  # (name, tensor) of the newest snapshot

Why a pair per worker and not one group over the pool: a torch/NCCL communicator cannot change
its members, and a member that dies leaves every collective of the group failing. A group over the
pool would be rebuilt at every join and leave, stalling every worker for each change, and one lost
worker would fail the weight load of all. A pair costs one connection per worker, is made when the
worker joins (from the run's store: no daemon, no new rendezvous) and dropped when it leaves; a dead
worker fails only its own transfer, which the server notices at once (the connection closes) or
after the timeout, and then forgets it. The price: the first training rank sends the model once per
worker and version, so its link's bandwidth is shared by the pool (a relay tree is the next step).

Protocol, through the run's TCP store (keys under `elastic/`):
  worker:  pair/<id> = epoch          a new pair group (stateless: its own PrefixStore namespace)
           ask/<id>/<n> = after       "the newest snapshot newer than `after`, please"
  server:  head/<id>/<n> = {version, sizes, rows} | None (nothing newer yet) and then, over the
           pair, each bucket broadcast from the server.
The worker cuts its own slices from the full tensors (the full path of the bridge).

A pair is a stateless gloo group on CPU and a stateless NCCL group with a GPU: made with the
process group class directly, outside torch.distributed's default group (each worker is a job of
its own, with a default group of its own or none).
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from verl_hpc.resharding.bridge import unpack
from verl_hpc.runtime.split import POLL_S, Mailbox

log = logging.getLogger(__name__)
PAIRS = "elastic/pairs"  # a counter: pair requests so far (the store cannot list its keys)


def pair_group(store, worker: str, epoch: int, rank: int, timeout_s: float):
    """The two-rank group of `worker` (rank 1) and the first training rank (rank 0), epoch `epoch`
    (a worker that reconnects makes a new one): gloo over host buffers, with the timeout, on GPU
    nodes too. A worker is another Slurm job that may die at any moment; on an NCCL group its
    timeout would reach the first training rank through NCCL's watchdog, which under
    TORCH_NCCL_ASYNC_ERROR_HANDLING (a process-wide setting) tears that process down, and the
    training job with it. Over gloo the timeout is an exception in the server thread, which forgets
    the worker. The price: the weights cross at TCP speed, staged through host memory."""
    prefix = dist.PrefixStore(f"elastic/pair/{worker}/{epoch}/", store)
    return dist.ProcessGroupGloo(prefix, rank, 2, datetime.timedelta(seconds=timeout_s))


class ElasticWeightServer:
    """The first training rank's server for elastic workers (module docstring)."""

    def __init__(self, connect: Callable[[], Mailbox], snapshot: Callable[[], Optional[tuple]],
                 timeout_s: float):
        """connect(): a mailbox on a store connection of the server thread's own; snapshot(): the
        newest (version, buckets, manifest) or None, the weight publisher's."""
        self.connect, self.snapshot, self.timeout_s = connect, snapshot, timeout_s
        self.pairs: Dict[str, object] = {}
        self.asked: Dict[str, int] = {}  # requests answered per worker
        self.lost: List[Tuple[str, str]] = []  # (worker, why) whose transfer failed
        self.sent: Dict[str, int] = {}  # snapshots sent per worker
        self._seen = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "ElasticWeightServer":
        self._thread = threading.Thread(target=self._serve, name="elastic-weight-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)

    def _serve(self) -> None:
        mail = self.connect()
        while not self._stop.is_set():
            self._accept(mail)
            busy = False
            for worker in list(self.pairs):
                key = f"elastic/ask/{worker}/{self.asked[worker]}"
                if mail.has(key):
                    busy = True
                    self._answer(mail, worker, key)
            if not busy:
                time.sleep(POLL_S)

    def _accept(self, mail: Mailbox) -> None:
        """New pair requests: make each worker's group (its rank 0 side)."""
        count = mail.add(PAIRS, 0)
        while self._seen < count:
            worker, epoch = mail.peek(f"elastic/pair/{self._seen}")
            self._seen += 1
            try:
                self.pairs[worker] = pair_group(mail.store, worker, epoch, 0, self.timeout_s)
                self.asked[worker] = 0
            except Exception as e:  # noqa: BLE001 - one worker's failure is that worker's
                self._drop(worker, f"its pair group did not form ({type(e).__name__}: {e})")

    def _answer(self, mail: Mailbox, worker: str, key: str) -> None:
        n = self.asked[worker]
        after = mail.take(key)
        snap = self.snapshot()
        if snap is None or snap[0] <= after:
            mail.put(f"elastic/head/{worker}/{n}", None)
            self.asked[worker] = n + 1
            return
        version, buckets, manifest = snap[:3]
        mail.put(f"elastic/head/{worker}/{n}", dict(version=version, sizes=[b.numel() for b in buckets], rows=manifest))
        self.asked[worker] = n + 1
        try:
            for b in buckets:
                buf = b.cpu()  # the pair is gloo (pair_group): host buffers
                self.pairs[worker].broadcast([buf], dist.BroadcastOptions()).wait()
            self.sent[worker] = self.sent.get(worker, 0) + 1
        except Exception as e:  # noqa: BLE001 - a dead worker fails its own transfer only
            self._drop(worker, f"its weight transfer failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")

    def _drop(self, worker: str, why: str) -> None:
        self.pairs.pop(worker, None)
        self.asked.pop(worker, None)
        self.lost.append((worker, why))
        log.warning("elastic weight server: rollout worker %s dropped: %s", worker, why)


class WeightFetcher:
    """A worker's side: its pair with the first training rank, and the newest snapshot over it."""

    def __init__(self, mail: Mailbox, worker: str, timeout_s: float, epoch: int = 0):
        self.mail, self.worker, self.timeout_s = mail, worker, timeout_s
        index = mail.add(PAIRS, 1) - 1
        mail.put(f"elastic/pair/{index}", (worker, epoch))
        self.pair = pair_group(mail.store, worker, epoch, 1, timeout_s)  # waits for the server's side
        self.asked = 0
        self.version = -1

    def newest(self, after: Optional[int] = None) -> Optional[Tuple[int, List[Tuple[str, torch.Tensor]]]]:
        """(version, [(name, tensor)]) of the newest snapshot newer than `after` (default: the one
        this worker holds), or None when there is none newer."""
        after = self.version if after is None else after
        n = self.asked
        self.mail.put(f"elastic/ask/{self.worker}/{n}", after)
        key = f"elastic/head/{self.worker}/{n}"
        self.mail.wait(key, "the first training rank's weight server", timeout_s=self.timeout_s)
        head = self.mail.take(key)
        self.asked = n + 1
        if head is None:
            return None
        by_bucket: Dict[int, list] = {}
        for row in head["rows"]:
            by_bucket.setdefault(row[3], []).append(row)
        tensors = []
        for i, size in enumerate(head["sizes"]):
            buf = torch.empty(size, dtype=torch.uint8)  # host memory: the pair is gloo (pair_group)
            self.pair.broadcast([buf], dist.BroadcastOptions()).wait()
            tensors += unpack(buf, by_bucket.get(i, []))
        self.version = int(head["version"])
        return self.version, tensors
