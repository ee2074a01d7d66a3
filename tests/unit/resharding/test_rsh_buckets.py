"""BucketStream: order kept, byte-bounded buckets, a tensor larger than a bucket goes alone, the
code-path counts (the first half of the memory bound), drain; bucket size validation."""
import pytest
import torch

from verl_hpc.resharding.buckets import MB, BucketStream, bucket_bytes_from, tensor_bytes


def _stream(sizes, dtype=torch.float32):
    """(name, tensor) with `sizes` elements each, values = index (to check order and content)."""
    return [(f"w{i}", torch.full((n,), float(i), dtype=dtype)) for i, n in enumerate(sizes)]


def _buckets_seen(stream: BucketStream):
    """Run the stream; return the list of buckets as lists of names (from the counters' view:
    a new bucket starts whenever `buckets` grew)."""
    out, last = [], 0
    for name, _ in stream:
        if stream.buckets != last:
            out.append([])
            last = stream.buckets
        out[-1].append(name)
    return out


def test_order_content_and_grouping():
    items = _stream([10, 10, 10, 10, 10])  # 40 bytes each
    s = BucketStream(iter(items), bucket_bytes=100)
    got = []
    for name, t in s:
        got.append((name, t.clone()))
    assert [n for n, _ in got] == [n for n, _ in items]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, items))
    assert s.buckets == 3  # 2 + 2 + 1 tensors of 40 bytes under 100
    assert s.tensors == 5 and s.bytes == 200
    assert s.peak_bucket_bytes == 80 and s.held_bytes == 0
    assert s.max_bucket_tensors == 2 and s.largest_tensor_bytes == 40
    assert s.source_exhausted and not s.source_failed


def test_grouping_boundaries():
    assert _buckets_seen(BucketStream(iter(_stream([25, 25, 25, 25])), 200)) == [["w0", "w1"], ["w2", "w3"]]
    # exactly full is still one bucket
    assert _buckets_seen(BucketStream(iter(_stream([50])), 200)) == [["w0"]]


def test_tensor_larger_than_bucket_goes_alone():
    s = BucketStream(iter(_stream([5, 1000, 5, 5])), bucket_bytes=64)
    assert _buckets_seen(s) == [["w0"], ["w1"], ["w2", "w3"]]
    assert s.peak_bucket_bytes == 4000 == s.largest_tensor_bytes
    assert s.tensors == 4


@pytest.mark.parametrize("bucket", [1, 7, 40, 64, 100, 4096])
def test_held_bytes_never_exceed_bucket_or_one_tensor(bucket):
    gen = torch.Generator().manual_seed(bucket)
    sizes = torch.randint(1, 30, (40,), generator=gen).tolist()
    s = BucketStream(iter(_stream(sizes)), bucket_bytes=bucket)
    held = []
    for _ in s:
        held.append(s.held_bytes)
    assert s.peak_bucket_bytes <= max(bucket, s.largest_tensor_bytes)
    assert max(held) <= max(bucket, s.largest_tensor_bytes)
    assert s.bytes == 4 * sum(sizes) and s.tensors == len(sizes)


def test_each_tensor_is_released_when_handed_on():
    """The bucket drops its reference as it hands a tensor on: a consumer that drops it too
    frees it before the next one is handed on (no hidden copy, no lingering reference)."""
    import weakref

    refs = []

    def source():
        for i in range(6):
            t = torch.zeros(100)
            refs.append(weakref.ref(t))
            yield f"w{i}", t
            del t

    s = BucketStream(source(), bucket_bytes=10_000)  # all six in one bucket
    alive_at_handover = []
    for k, (_, t) in enumerate(s):
        del t
        alive_at_handover.append(sum(r() is not None for r in refs[:k + 1]))
    # when tensor k is handed on, only it is alive (the stream's frame holds it until resumed):
    # tensors 0..k-1 were dropped by the bucket and by us
    assert alive_at_handover == [1] * 6


def test_export_time_is_counted_inside_the_source():
    import time

    def slow():
        for i in range(3):
            time.sleep(0.02)
            yield f"w{i}", torch.zeros(4)

    s = BucketStream(slow(), bucket_bytes=MB)
    list(s)
    assert s.export_seconds >= 0.05


def test_drain_runs_the_rest_of_the_source():
    pulled = []

    def source():
        for i in range(10):
            pulled.append(i)
            yield f"w{i}", torch.zeros(10)

    s = BucketStream(source(), bucket_bytes=80)  # two per bucket
    it = iter(s)
    next(it)
    next(it)
    assert pulled == [0, 1, 2]  # w2 did not fit: it opened the next bucket
    assert s.drain() == 7
    assert pulled == list(range(10)) and s.source_exhausted
    assert s.drain() == 0


def test_source_failure_is_marked_and_not_drained():
    def broken():
        yield "w0", torch.zeros(1)
        raise RuntimeError("collective broke")

    s = BucketStream(broken(), bucket_bytes=MB)
    with pytest.raises(RuntimeError, match="collective broke"):
        list(s)
    assert s.source_failed
    assert s.drain() == 0


def test_a_stream_is_iterated_once():
    s = BucketStream(iter(_stream([1])), bucket_bytes=8)
    list(s)
    with pytest.raises(RuntimeError, match="once"):
        list(s)


def test_bucket_size_from_config_values():
    assert bucket_bytes_from(512) == 512 * MB
    assert bucket_bytes_from(0.5) == MB // 2
    assert bucket_bytes_from(bucket_bytes=1000) == 1000
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        bucket_bytes_from(0)
    with pytest.raises(ValueError, match="exactly one"):
        bucket_bytes_from(1, 1000)
    with pytest.raises(ValueError, match="exactly one"):
        bucket_bytes_from()


def test_tensor_bytes_counts_dtype():
    assert tensor_bytes(torch.zeros(3, 5, dtype=torch.bfloat16)) == 30
    assert tensor_bytes(torch.zeros(3, 5)[:, :2]) == 24  # a view counts its own elements
