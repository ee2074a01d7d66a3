"""Weights to elastic rollout workers: a two-rank group per worker with the first training rank,
which serves them the same snapshot it serves the fixed rollout group (resharding/bridge.py).

    server = ElasticWeightServer(connect, snapshot, timeout_s)   # first training rank; threads
    server.start(); ... server.close()                           # connect(): a Mailbox of its own
    fetch = WeightFetcher(mailbox, member, timeout_s)            # a worker, another Slurm job
    version, tensors = fetch.newest(after=-1)                  # (name, tensor) of the newest snapshot

Why a pair per worker and not one group over the pool: a torch/NCCL communicator cannot change
its members, and a member that dies leaves every collective of the group failing. A group over the
pool would be rebuilt at every join and leave, stalling every worker for each change, and one lost
worker would fail the weight load of all. A pair costs one connection per worker, is made when the
worker joins (from the run's store: no daemon, no new rendezvous) and dropped when it leaves. The
price: the first training rank sends the model once per worker and version, so its link's
bandwidth is shared by the pool (a relay tree is the next step).

Why a thread per worker: whatever waits on one worker must not hold another's fetch. A worker
killed while its pair forms leaves the server's side of the rendezvous waiting for a peer that will
never come, and a worker whose node is lost mid-transfer leaves a send waiting for a reader: on a
single serving thread either wait (up to the timeout) stalled every other worker's fetch, and they
left the pool one by one at their own timeouts. So a door thread only takes pair requests, and each
worker is served by a thread of its own, on a store connection of its own (gloo's rendezvous blocks
the connection it waits on). A dead worker is found by its connection where the kernel closes it
(SIGKILL, a crash: the transfer fails at once), else by the bounds: a pair not formed within
`FORM_S`, a transfer not done within `timeout_s`; and a worker the run took out of the pool (its
goodbye, its heartbeat's silence, its requeue) by the coordinator's `left/<member>` key, which ends
its thread. Each bound costs that worker's own thread, never another's.

Protocol, through the run's TCP store (keys under `elastic/`; `member` is the worker's name and
its join's number, coordinator.member_key):
  worker:  pairs (a counter), pair/<i> = (member, epoch)   a new pair group (its own PrefixStore namespace)
           ask/<member>/<n> = after       "the newest snapshot newer than `after`, please"
  server:  head/<member>/<n> = {version, sizes, rows} | None (nothing newer yet) and then, over the
           pair, each bucket broadcast from the server.
  coordinator: left/<member> = why        it has left the pool: the server forgets it
The worker cuts its own slices from the full tensors (the full path of the bridge).

A pair is a stateless gloo group on CPU and on GPU nodes alike (pair_group says why): made with
the process group class directly, outside torch.distributed's default group (each worker is a job
of its own, with a default group of its own or none).
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
from verl_hpc.runtime.split import POLL_S, GroupLostError, Mailbox

log = logging.getLogger(__name__)
PAIRS = "elastic/pairs"  # a counter: pair requests so far (the store cannot list its keys)
FORM_S = 30.0  # a pair forms in milliseconds once both sides are in: a side not there by then is dead or stuck
LEFT_CHECK_S = 1.0  # how often a worker's thread looks whether the run took it out of the pool


def left_key(member: str) -> str:
    """Posted by the coordinator when `member` leaves the pool (any reason): its server thread ends."""
    return f"elastic/left/{member}"


def pair_group(store, worker: str, epoch: int, rank: int, timeout_s: float):
    """The two-rank group of `worker` (rank 1) and the first training rank (rank 0), epoch `epoch`
    (a worker that reconnects makes a new one): gloo over host buffers, with the timeout, on GPU
    nodes too. A worker is another Slurm job that may die at any moment; on an NCCL group its
    timeout would reach the first training rank through NCCL's watchdog, which under
    TORCH_NCCL_ASYNC_ERROR_HANDLING (a process-wide setting) tears that process down, and the
    training job with it. Over gloo the timeout is an exception in the server's thread for that
    worker, which forgets it. The price: the weights cross at TCP speed, staged through host memory.
    `timeout_s` bounds the group's forming; each broadcast passes its own (`transfer_options`)."""
    prefix = dist.PrefixStore(f"elastic/pair/{worker}/{epoch}/", store)
    return dist.ProcessGroupGloo(prefix, rank, 2, datetime.timedelta(seconds=timeout_s))


def transfer_options(timeout_s: float) -> "dist.BroadcastOptions":
    """A bucket's broadcast over a pair, bounded by `timeout_s` (not the shorter forming bound)."""
    opts = dist.BroadcastOptions()
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return opts


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class ElasticWeightServer:
    """The first training rank's server for elastic workers (module docstring)."""

    def __init__(self, connect: Callable[[], Mailbox], snapshot: Callable[[], Optional[tuple]],
                 timeout_s: float):
        """connect(): a mailbox on a store connection of its own (one per thread); snapshot(): the
        newest (version, buckets, manifest) or None, the weight publisher's."""
        self.connect, self.snapshot, self.timeout_s = connect, snapshot, timeout_s
        self.form_s = min(FORM_S, timeout_s)
        self.lost: List[Tuple[str, str]] = []  # (worker, why) whose pair or transfer failed
        self.sent: Dict[str, int] = {}  # snapshots sent per worker
        self.threads: Dict[str, threading.Thread] = {}  # the workers' threads still running
        self._lock = threading.Lock()
        self._seen = 0
        self._stop = threading.Event()
        self._door: Optional[threading.Thread] = None

    def start(self) -> "ElasticWeightServer":
        self._door = threading.Thread(target=self._take_pairs, name="elastic-weight-server", daemon=True)
        self._door.start()
        return self

    def close(self) -> None:
        """Stop the door and every worker's thread; a thread in a transfer ends within its bound."""
        self._stop.set()
        deadline = time.monotonic() + self.timeout_s
        for t in [self._door, *list(self.threads.values())]:
            if t is not None:
                t.join(max(0.0, deadline - time.monotonic()))

    def _take_pairs(self) -> None:
        """The door: each new pair request gets a thread of its own (and nothing else is done here)."""
        try:
            mail = self.connect()
            while not self._stop.is_set():
                count = mail.add(PAIRS, 0)
                while self._seen < count:
                    member, epoch = mail.peek(f"elastic/pair/{self._seen}")
                    self._seen += 1
                    self._spawn(member, epoch)
                self._stop.wait(POLL_S)
        except GroupLostError as e:  # the run's store is gone: the run is ending
            log.info("elastic weight server: stopping (%s)", e)

    def _spawn(self, member: str, epoch: int) -> None:
        with self._lock:
            for name in [n for n, t in self.threads.items() if not t.is_alive()]:
                del self.threads[name]
            t = threading.Thread(target=self._serve, args=(member, epoch), daemon=True,
                                 name=f"elastic-weights-{member}")
            self.threads[member] = t
        t.start()

    def _serve(self, member: str, epoch: int) -> None:
        """One worker's thread: its pair, then its requests, until it leaves, fails or the server closes."""
        try:
            mail = self.connect()  # its own connection: gloo's rendezvous blocks the one it waits on
        except GroupLostError:
            return
        try:
            pair = pair_group(mail.store, member, epoch, 0, self.form_s)
        except Exception as e:  # noqa: BLE001 - one worker's failure is that worker's
            return self._drop(member, f"its pair group did not form within {self.form_s:.0f} s ({_first_line(e)})")
        n, look_left = 0, time.monotonic() + LEFT_CHECK_S
        try:
            while not self._stop.is_set():
                key = f"elastic/ask/{member}/{n}"
                if mail.has(key):
                    if not self._answer(mail, pair, member, n, mail.take(key)):
                        return
                    n += 1
                    continue
                if time.monotonic() > look_left:
                    if mail.has(left_key(member)):
                        return  # out of the pool (its goodbye, its silence, its requeue): nothing to drop
                    look_left = time.monotonic() + LEFT_CHECK_S
                self._stop.wait(POLL_S)
        except GroupLostError as e:  # the run's store is gone: the run is ending
            log.info("elastic weight server: worker %s's thread stopping (%s)", member, e)

    def _answer(self, mail: Mailbox, pair, member: str, n: int, after: int) -> bool:
        """Request n: the newest snapshot's head, then its buckets over the pair; False if the
        transfer failed (the worker is dropped)."""
        snap = self.snapshot()
        if snap is None or snap[0] <= after:
            mail.put(f"elastic/head/{member}/{n}", None)
            return True
        version, buckets, manifest = snap[:3]
        mail.put(f"elastic/head/{member}/{n}", dict(version=version, sizes=[b.numel() for b in buckets], rows=manifest))
        try:
            opts = transfer_options(self.timeout_s)
            for b in buckets:
                pair.broadcast([b.cpu()], opts).wait()  # the pair is gloo (pair_group): host buffers
        except Exception as e:  # noqa: BLE001 - a dead worker fails its own transfer only
            self._drop(member, f"its weight transfer failed ({_first_line(e)})")
            return False
        with self._lock:
            self.sent[member] = self.sent.get(member, 0) + 1
        return True

    def _drop(self, member: str, why: str) -> None:
        with self._lock:
            self.lost.append((member, why))
        log.warning("elastic weight server: rollout worker %s dropped: %s", member, why)


class WeightFetcher:
    """A worker's side: its pair with the first training rank, and the newest snapshot over it."""

    def __init__(self, mail: Mailbox, worker: str, timeout_s: float, epoch: int = 0):
        """worker: the member's name in the store (coordinator.member_key: its name and join)."""
        self.mail, self.worker, self.timeout_s = mail, worker, timeout_s
        index = mail.add(PAIRS, 1) - 1
        mail.put(f"elastic/pair/{index}", (worker, epoch))
        # waits for the server's side (its thread starts within a poll of the request)
        self.pair = pair_group(mail.store, worker, epoch, 1, min(FORM_S, timeout_s))
        self.asked = 0
        self.version = -1

    def newest(self, after: Optional[int] = None) -> Optional[Tuple[int, List[Tuple[str, torch.Tensor]]]]:
        """(version, [(name, tensor)]) of the newest snapshot newer than `after` (default: the one
        this worker holds), or None when there is none newer."""
        after = self.version if after is None else after
        n = self.asked
        self.mail.put(f"elastic/ask/{self.worker}/{n}", after)
        key = f"elastic/head/{self.worker}/{n}"
        # a worker the run took out of the pool (reaped while alive: a long pause) has no server
        # thread any more: it hears so at once instead of waiting out the timeout
        if not self.mail.wait(key, "the first training rank's weight server", timeout_s=self.timeout_s,
                              unless=left_key(self.worker)):
            raise GroupLostError(f"{self.mail.me}: the run took it out of the pool "
                                 f"({self.mail.peek(left_key(self.worker))})")
        head = self.mail.take(key)
        self.asked = n + 1
        if head is None:
            return None
        by_bucket: Dict[int, list] = {}
        for row in head["rows"]:
            by_bucket.setdefault(row[3], []).append(row)
        tensors = []
        opts = transfer_options(self.timeout_s)
        for i, size in enumerate(head["sizes"]):
            buf = torch.empty(size, dtype=torch.uint8)  # host memory: the pair is gloo (pair_group)
            self.pair.broadcast([buf], opts).wait()
            tensors += unpack(buf, by_bucket.get(i, []))
        self.version = int(head["version"])
        return self.version, tensors
