"""`BucketStream`: a (name, tensor) stream regrouped into byte-bounded buckets, with the counts
that the sync metrics and the memory bound are made of.

The producer is the collective export (TP all-gather, PP broadcast per tensor), the consumer the
rollout engine's `load_weights`, which takes ONE lazy iterator for the whole model (a partial
update corrupts vLLM's fused layers, see verl_hpc/rollout/weights.py). Between the two, tensors
are pulled from the producer until the next one would overflow the bucket, then the bucket is
handed over tensor by tensor. Why buckets rather than strict one-in-one-out:
- the collective phase and the local loading phase alternate once per bucket, not once per
  tensor, so a rank that loads slower (a busy core, a straggler) costs the others one wait per
  bucket instead of one per tensor;
- the bucket is the unit the memory bound is stated in: at most `bucket_bytes` (or one tensor, if
  a single tensor is larger: it then forms a bucket alone, which is not an error) is ever held here.

No copy is made: a bucket holds the tensors the export produced (fresh gathered tensors, or views
of live parameters where nothing had to be gathered) and drops each reference as it is handed on.
The last bucket is handed on after the producer is exhausted, so the producer's parameters must
stay on the device until the consumer has returned (resharding.sync.held_resident).
The consumer may keep a tensor a while (vLLM buffers a fused layer's pieces until all arrived), so
the bucket's storage must not be reused: the references are simply released.

Counted (all per rank): tensors and bytes handed on, buckets, the peak of bytes held in the
bucket, the largest tensor, and the seconds spent inside the producer (`export_seconds`); the
rest of the wall time of a load is the consumer's.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, List, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError

MB = 1 << 20
Item = Tuple[str, torch.Tensor]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def in_dtype(items: Iterable[Item], dtype: Optional[torch.dtype]) -> Iterator[Item]:
    """The stream with its floating-point tensors in `dtype`, the rollout's (None: as exported).
    The sync then carries what the rollout keeps: an engine whose export is in another dtype (the
    FSDP engine's fp32 master weights) is cast once, on the sending side, with the same
    round-to-nearest the rollout's own copy into its parameters would apply, and the buckets hold
    half the bytes for a bf16 or fp16 rollout. Tensors already in `dtype` pass as they are (views
    of live parameters stay views)."""
    for name, t in items:
        yield name, (t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t)


def bucket_bytes_from(bucket_mb: Optional[float] = None, bucket_bytes: Optional[int] = None) -> int:
    """Bytes per bucket from `resharding.bucket_mb` (MiB, may be fractional here) or bytes."""
    if (bucket_mb is None) == (bucket_bytes is None):
        raise ValueError("give exactly one of bucket_mb (resharding.bucket_mb) or bucket_bytes")
    value = int(bucket_bytes if bucket_bytes is not None else float(bucket_mb) * MB)
    if value < 1:
        got = f"{bucket_mb} MiB" if bucket_mb is not None else f"{bucket_bytes} bytes"
        raise ConfigError(f"resharding.bucket_mb must be > 0; got {got}")
    return value


class SourceStream:
    """A collective (name, tensor) source, passed through as is, with what the sync's failure
    handling needs: the seconds spent inside the source, whether it ran to its end or failed, and
    `drain()`: a collective producer must be run to its end on every rank even when this rank's
    consumer failed, or the other ranks would wait in the next collective forever."""

    def __init__(self, source: Iterable):
        self._source = iter(source)
        self.tensors = 0  # handed on
        self.export_seconds = 0.0
        self.source_exhausted = False
        self.source_failed = False
        self._started = False

    def _pull(self):
        start = time.perf_counter()
        try:
            item = next(self._source)
        except StopIteration:
            self.source_exhausted = True
            return None
        except BaseException:
            self.source_failed = True
            raise
        finally:
            self.export_seconds += time.perf_counter() - start
        return item

    def __iter__(self) -> Iterator:
        if self._started:
            raise RuntimeError("a weight stream can be iterated once")
        self._started = True
        while True:
            item = self._pull()
            if item is None:
                return
            self.tensors += 1
            yield item

    def close(self) -> None:
        """Close the source (a generator: its `finally` blocks run now, not at garbage collection)."""
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def drain(self) -> int:
        """Run the rest of the source to its end, discarding; returns the tensors discarded."""
        dropped = 0
        while not (self.source_exhausted or self.source_failed):
            if self._pull() is not None:
                dropped += 1
        return dropped


class BucketStream(SourceStream):
    """Iterate `source` through buckets of at most `bucket_bytes` (a larger tensor goes alone)."""

    def __init__(self, source: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}")
        super().__init__(source)
        self.bucket_bytes = int(bucket_bytes)
        self.bytes = 0  # handed on
        self.buckets = 0
        self.held_bytes = 0  # in the bucket now
        self.peak_bucket_bytes = 0
        self.largest_tensor_bytes = 0
        self.max_bucket_tensors = 0

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a BucketStream can be iterated once")
        self._started = True
        bucket: List[Tuple[str, torch.Tensor]] = []
        while True:
            item = self._pull()
            if item is None:
                break
            size = tensor_bytes(item[1])
            self.largest_tensor_bytes = max(self.largest_tensor_bytes, size)
            if bucket and self.held_bytes + size > self.bucket_bytes:
                yield from self._hand_on(bucket)
            bucket.append(item)
            item = None  # the bucket holds the only reference of this frame
            self.held_bytes += size
            self.peak_bucket_bytes = max(self.peak_bucket_bytes, self.held_bytes)
        yield from self._hand_on(bucket)

    def _hand_on(self, bucket: List[Item]) -> Iterator[Item]:
        if not bucket:
            return
        self.buckets += 1
        self.max_bucket_tensors = max(self.max_bucket_tensors, len(bucket))
        bucket.reverse()  # pop() from the end hands them on in order
        while bucket:
            name, tensor = bucket.pop()
            size = tensor_bytes(tensor)
            self.held_bytes -= size
            self.tensors += 1
            self.bytes += size
            yield name, tensor
            del tensor  # do not keep the consumer's tensor alive while it works on the next one
