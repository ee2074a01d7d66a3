"""The weight step of split placement: the training group's new weights to the rollout group,
bucketed, over a collective between the groups, while generation goes on.

    publisher = WeightPublisher(world, bucket_bytes)       # training ranks
    publisher.publish(actor, version)                       # collective over the training group
    receiver = WeightReceiver(world)                        # rollout ranks
    receiver.newest()                                       # the newest published version (leader polls)
    version, metrics = receiver.load(rollout)               # collective over the rollout group

Publish: every training rank runs the actor's export (Megatron's TP gathers and PP broadcasts are
collectives over the training group, as in the colocated sync); the first training rank packs the
full HF tensors into flat byte buckets of `resharding.bucket_mb` (a copy: the export's tensors may
be views of live parameters that the next update changes) and announces the version. A server
thread on that rank answers each rollout request with the newest snapshot, bucket by bucket, over
the weights group (first training rank + every rollout rank). So the trainer never waits for the
rollout to take its weights, and the rollout pauses generation only for the load itself; it takes
the newest version, skipping any it was too busy to take.

Load: the rollout leader asks for the weights, learns the snapshot's manifest (names, dtypes,
shapes, offsets) through the mailbox and shares it with the rollout group. A stop of the trainer
never leaves a request waiting: the server takes a request atomically (`Mailbox.claim`), so either
it answers (the weights; or, once closing, a manifest of None: none come) or the rollout leader,
seeing the trainer's STOP, withdraws its request and stops without them. Sliced (resharding.mode
sliced or auto: `slicer` given): per bucket one exchange over the weights group in which the first
training rank sends each rollout rank only the slices its engine keeps (verl_hpc.resharding.plan's
RolloutSlicer, cut from the snapshot), so a rollout rank receives its shard, not the model. Full
(resharding.mode full): every bucket is broadcast whole and each engine cuts its own slices. Either
way the tensors (views into the bucket; full-shape carriers for the sliced path, as in the colocated
sync) go to ONE `rollout.load_weights` call.

Not yet: the slices come from the first training rank's snapshot, not straight from the training
ranks that hold them (the snapshot is what lets training run on while the rollout takes its
weights); resharding.delta is not offered here.

Memory: the snapshot holds one full copy of the policy in the first training rank's host (CPU) or
device memory, plus one bucket in flight on every member (sliced: the first training rank's bucket
cut for every rollout rank, up to the bucket x rollout ranks / rollout.tp).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from verl_hpc.resharding.buckets import bucket_bytes_from, in_dtype
from verl_hpc.resharding.plan import Need, PlanError, RolloutSlicer
from verl_hpc.resharding.sync import carriers, export_source, held_resident
from verl_hpc.runtime.split import POLL_S, STOP

log = logging.getLogger(__name__)
ALIGN = 64  # byte offset of every tensor in a bucket: any dtype's view of it is aligned


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def pack(tensors, bucket_bytes: int) -> Tuple[List[torch.Tensor], List[tuple]]:
    """(flat uint8 buckets, manifest rows (name, dtype, shape, bucket, offset, nbytes))."""
    buckets, manifest, parts, used = [], [], [], 0

    def close():
        nonlocal parts, used
        if parts:
            buf = torch.zeros(used, dtype=torch.uint8)
            for off, flat in parts:
                buf[off:off + flat.numel()] = flat
            buckets.append(buf)
        parts, used = [], 0

    for name, t in tensors:
        flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        if used and used + flat.numel() > bucket_bytes:
            close()
        manifest.append((name, str(t.dtype), tuple(t.shape), len(buckets), used, flat.numel()))
        parts.append((used, flat.clone()))
        used += -(-flat.numel() // ALIGN) * ALIGN
    close()
    return buckets, manifest


def unpack(bucket: torch.Tensor, rows) -> List[Tuple[str, torch.Tensor]]:
    """The tensors of one bucket, as views into it."""
    return [(name, bucket[off:off + n].view(_dtype(dt)).view(shape)) for name, dt, shape, _, off, n in rows]


def slice_manifest(manifest, slicer: RolloutSlicer, ranks: int):
    """Per rollout rank: (bytes per bucket, rows (name, dtype, full shape, bucket, (dim, start,
    stop), offset in its bucket buffer, nbytes)): the part of each snapshot tensor it keeps."""
    buckets = 1 + max((row[3] for row in manifest), default=-1)
    sizes, rows = [[0] * buckets for _ in range(ranks)], [[] for _ in range(ranks)]
    for name, dt, shape, b, _, nbytes in manifest:
        element = nbytes // max(1, torch.Size(shape).numel())
        for r in range(ranks):
            dim, start, stop = slicer.need(name, shape, r % slicer.tp)
            n = torch.Size(shape).numel() // max(shape[dim], 1) * (stop - start) * element
            rows[r].append((name, dt, tuple(shape), b, (dim, start, stop), sizes[r][b], n))
            sizes[r][b] += -(-n // ALIGN) * ALIGN
    return sizes, rows


def slice_buffer(bucket: torch.Tensor, b: int, manifest, sliced) -> torch.Tensor:
    """Snapshot bucket `b` cut for the rollout ranks: every rank's part, in rank order, each tensor's
    slice at its offset (slice_manifest)."""
    sizes, rows = sliced
    full = {row[0]: row for row in manifest if row[3] == b}
    send = torch.zeros(sum(sz[b] for sz in sizes), dtype=torch.uint8)
    base = 0
    for r, mine in enumerate(rows):
        for name, dt, shape, rb, (dim, start, stop), off, n in mine:
            if rb == b:
                _, _, _, _, full_off, full_n = full[name]
                whole = bucket[full_off:full_off + full_n].view(_dtype(dt)).view(shape)
                part = whole.narrow(dim, start, stop - start)
                send[base + off:base + off + n].view(part.dtype).view(part.shape).copy_(part)
        base += sizes[r][b]
    return send


def slices_in(buf: torch.Tensor, rows, rank: int) -> Iterator[Tuple[str, torch.Tensor, Need]]:
    """A rollout rank's received bucket as (name, its slice, what it is), views into `buf`."""
    for name, dt, shape, _, (dim, start, stop), off, n in rows:
        part_shape = list(shape)
        part_shape[dim] = stop - start
        yield name, buf[off:off + n].view(_dtype(dt)).view(part_shape), Need(rank, name, dim, start, stop)


class WeightPublisher:
    def __init__(self, world, *, bucket_mb: Optional[float] = None, bucket_bytes: Optional[int] = None,
                 slicer: Optional[RolloutSlicer] = None, dtype: Optional[torch.dtype] = None):
        """slicer: what each rollout rank keeps (resharding.mode sliced/auto): each gets only its
        slices; None: every rollout rank gets every full tensor (resharding.mode full). dtype: the
        rollout's weight dtype, what the snapshot holds (buckets.in_dtype; None: as exported)."""
        self.world = world
        self.slicer = slicer
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes_from(bucket_mb, bucket_bytes)
        self.version = -1
        self._snapshot = None  # (version, buckets, manifest), the leader's
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self.served = 0
        self.error: Optional[BaseException] = None

    def publish(self, actor, version: int) -> Dict[str, float]:
        """Export the actor's weights (collective over the training group) and make them the
        newest the rollout can take. Returns sync/* metrics of the export."""
        t0 = time.perf_counter()
        with held_resident(actor):
            stream = in_dtype(export_source(actor)(), self.dtype)
            if self.world.is_leader:
                buckets, manifest = pack(stream, self.bucket_bytes)
                sliced = self._slice(manifest)
            else:
                for _ in stream:  # the export is collective: every training rank runs it
                    pass
        seconds = time.perf_counter() - t0
        self.version = version
        m = {"sync/export_seconds": seconds}
        if self.world.is_leader:
            with self._lock:
                self._snapshot = (version, buckets, manifest, sliced)
            self.world.mailbox.put("weights/latest", version)
            self._ensure_server()
            m.update({"sync/bytes": float(sum(b.numel() for b in buckets)), "sync/buckets": float(len(buckets))})
        if self.error is not None:
            raise self.error
        return m

    def latest(self) -> Optional[tuple]:
        """(version, buckets, manifest) of the newest snapshot, None before the first: what the
        elastic workers' weight server sends (trainer/placement/elastic/channel.py). Leader only."""
        with self._lock:
            return None if self._snapshot is None else self._snapshot[:3]

    def _slice(self, manifest):
        if self.slicer is None:
            return None
        try:
            return slice_manifest(manifest, self.slicer, self.world.rollout_ranks)
        except PlanError as e:  # resharding.mode=auto: the full buckets, said once
            log.warning("weight publisher: no sliced plan for rollout.tp=%d (%s); every rollout rank "
                        "takes the full tensors", self.slicer.tp, e)
            self.slicer = None
            return None

    def _ensure_server(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        """Answer the rollout's requests `weights/request/<n>` in order with the newest snapshot;
        once closing, a request still taken is answered with None (no weights come) and the
        server ends; one it did not take, the rollout leader withdraws (WeightReceiver)."""
        mailbox = self.world.thread_mailbox()  # a store connection of its own
        try:
            while True:
                closing = self._stop.is_set()  # read before the claim: what it then takes it answers so
                if not mailbox.claim(f"weights/request/{self.served}"):
                    if closing:
                        return
                    time.sleep(POLL_S)
                    continue
                if closing:
                    mailbox.put(f"weights/manifest/{self.served}", None)
                    return
                with self._lock:
                    version, buckets, manifest, sliced = self._snapshot
                if sliced is None:
                    mailbox.put(f"weights/manifest/{self.served}",
                                dict(version=version, sizes=[len(b) for b in buckets], rows=manifest))
                    for b in buckets:
                        self.world.broadcast(b)
                else:
                    self._serve_slices(mailbox, version, buckets, manifest, sliced)
                self.served += 1
        except BaseException as e:  # noqa: BLE001 - surfaced by the next publish() on the main thread
            self.error = e
            log.error("weight server: %s: %s", type(e).__name__, e)

    def _serve_slices(self, mailbox, version, buckets, manifest, sliced) -> None:
        """Each rollout rank gets only its slices: per bucket one exchange in which this rank sends
        every rollout rank its part (cut from the snapshot) and receives nothing."""
        sizes, rows = sliced
        mailbox.put(f"weights/manifest/{self.served}",
                    dict(version=version, sizes=sizes, rows=rows, tp=self.slicer.tp))
        for b, bucket in enumerate(buckets):
            self.world.scatter(slice_buffer(bucket, b, manifest, sliced), [sz[b] for sz in sizes])

    def close(self) -> None:
        """Stop serving (after the trainer's STOP is out, so that no request is left unanswered);
        a snapshot being sent is sent to the end (the rollout is taking it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.world.timeout_s)


class WeightReceiver:
    def __init__(self, world, rollout_group_broadcast):
        """rollout_group_broadcast(obj) -> obj: the leader's object on every rollout rank."""
        self.world = world
        self.share = rollout_group_broadcast
        self.requests = 0
        self.version = -1

    def newest(self) -> int:
        """The newest version the trainer published (-1: none yet). Leader only."""
        mb = self.world.mailbox
        return int(mb.peek("weights/latest")) if mb.has("weights/latest") else -1

    def load(self, rollout) -> Optional[Tuple[int, Dict[str, float]]]:
        """Take the newest snapshot into `rollout` (collective over the rollout group); None, with
        nothing loaded, when the trainer stopped instead of sending it."""
        t0 = time.perf_counter()
        head = self.share(self._ask() if self.world.is_leader else None)
        self.requests += 1
        if head is None:
            return None
        if "tp" in head:  # sliced: this rank's slices only
            return self._load_slices(rollout, head, t0)
        version, sizes, manifest = head["version"], head["sizes"], head["rows"]
        by_bucket: Dict[int, list] = {}
        for row in manifest:
            by_bucket.setdefault(row[3], []).append(row)

        def stream():
            for i, size in enumerate(sizes):
                buf = torch.empty(size, dtype=torch.uint8, device=self.world.wire_device())  # GPU under NCCL
                self.world.broadcast(buf)
                yield from unpack(buf, by_bucket.get(i, []))

        rollout.load_weights(stream())
        self.version = int(version)
        seconds = time.perf_counter() - t0
        nbytes = float(sum(sizes))
        return self.version, {"sync/seconds": seconds, "sync/bytes": nbytes, "sync/sliced": 0.0,
                              "sync/gb_per_s": nbytes / max(seconds, 1e-9) / 1e9, "sync/buckets": float(len(sizes))}

    def _ask(self) -> Optional[dict]:
        """Leader: request the weights; the manifest of what the server will send, or None when the
        trainer stopped first (its STOP seen and the request withdrawn before the server took it,
        or the server, closing, answered None)."""
        mb, n = self.world.mailbox, self.requests
        request, key, who = f"weights/request/{n}", f"weights/manifest/{n}", "the first training rank's weight server"
        mb.put(request, True)
        if not mb.wait(key, who, unless=STOP) and mb.claim(request):
            return None  # withdrawn: the server never took it, nothing will be sent
        mb.wait(key, who)  # (at once when it is there) the server took it: its answer comes whatever the trainer does
        return mb.take(key)

    def _load_slices(self, rollout, head, t0) -> Tuple[int, Dict[str, float]]:
        me = self.world.local_env.rank
        sizes, rows, tp = head["sizes"][me], head["rows"][me], head["tp"]
        keeps = tuple(rollout.weight_slices())
        if keeps != (me % tp, tp):
            raise RuntimeError(f"rollout rank {me} keeps the slices of inference TP rank {keeps[0]} of "
                               f"{keeps[1]}, the trainer cut them for {me % tp} of {tp} (rollout.tp)")
        by_bucket: Dict[int, list] = {}
        for row in rows:
            by_bucket.setdefault(row[3], []).append(row)
        shapes = {row[0]: row[2] for row in rows}

        def stream():
            for i, size in enumerate(sizes):
                buf = torch.empty(size, dtype=torch.uint8, device=self.world.wire_device())
                self.world.scatter(buf, None)
                yield from slices_in(buf, by_bucket.get(i, []), me)

        rollout.load_weights(carriers(stream(), shapes))
        self.version = int(head["version"])
        seconds = time.perf_counter() - t0
        nbytes = float(sum(sizes))
        return self.version, {"sync/seconds": seconds, "sync/bytes": nbytes, "sync/sliced": 1.0,
                              "sync/gb_per_s": nbytes / max(seconds, 1e-9) / 1e9, "sync/buckets": float(len(sizes))}
