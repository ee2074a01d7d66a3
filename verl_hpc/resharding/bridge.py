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
shapes, offsets) through the mailbox and shares it with the rollout group; each rollout rank then
receives every bucket and feeds the tensors, views into the bucket, to ONE `rollout.load_weights`
call, which cuts its inference-TP slices as in the colocated sync.

Memory: the snapshot holds one full copy of the policy in the first training rank's host (CPU) or
device memory, plus one bucket in flight on every member.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from verl_hpc.resharding.buckets import bucket_bytes_from
from verl_hpc.resharding.sync import export_source, held_resident
from verl_hpc.runtime.split import POLL_S

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


class WeightPublisher:
    def __init__(self, world, *, bucket_mb: Optional[float] = None, bucket_bytes: Optional[int] = None):
        self.world = world
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
            stream = export_source(actor)()
            if self.world.is_leader:
                buckets, manifest = pack(stream, self.bucket_bytes)
            else:
                for _ in stream:  # the export is collective: every training rank runs it
                    pass
        seconds = time.perf_counter() - t0
        self.version = version
        m = {"sync/export_seconds": seconds}
        if self.world.is_leader:
            with self._lock:
                self._snapshot = (version, buckets, manifest)
            self.world.mailbox.put("weights/latest", version)
            self._ensure_server()
            m.update({"sync/bytes": float(sum(b.numel() for b in buckets)), "sync/buckets": float(len(buckets))})
        if self.error is not None:
            raise self.error
        return m

    def _ensure_server(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        """Answer the rollout's requests `weights/request/<n>` in order with the newest snapshot."""
        mailbox = self.world.thread_mailbox()  # a store connection of its own
        try:
            while not self._stop.is_set():
                key = f"weights/request/{self.served}"
                if not mailbox.has(key):
                    time.sleep(POLL_S)
                    continue
                mailbox.take(key)
                with self._lock:
                    version, buckets, manifest = self._snapshot
                mailbox.put(f"weights/manifest/{self.served}", (version, [len(b) for b in buckets], manifest))
                for b in buckets:
                    self.world.broadcast(b)
                self.served += 1
        except BaseException as e:  # noqa: BLE001 - surfaced by the next publish() on the main thread
            self.error = e
            log.error("weight server: %s: %s", type(e).__name__, e)

    def close(self) -> None:
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

    def load(self, rollout) -> Tuple[int, Dict[str, float]]:
        """Take the newest snapshot into `rollout` (collective over the rollout group)."""
        t0 = time.perf_counter()
        head = None
        if self.world.is_leader:
            mb = self.world.mailbox
            mb.put(f"weights/request/{self.requests}", True)
            key = f"weights/manifest/{self.requests}"
            mb.wait(key, "the first training rank's weight server")
            head = mb.take(key)
        version, sizes, manifest = self.share(head)
        self.requests += 1
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
        return self.version, {"sync/seconds": seconds, "sync/bytes": nbytes,
                              "sync/gb_per_s": nbytes / max(seconds, 1e-9) / 1e9, "sync/buckets": float(len(sizes))}
