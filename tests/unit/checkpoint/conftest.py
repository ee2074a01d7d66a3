"""Helpers for the checkpoint unit tests: ranks simulated as threads, reproducible tensors, bitwise equality."""
import threading
import zlib

import pytest
import torch

from verl_hpc.checkpoint.comm import ThreadWorld


def run_ranks(n, fn, timeout=60):
    """fn(rank, comm) on n threads sharing a ThreadWorld; the results by rank (errors re-raised)."""
    world = ThreadWorld(n, timeout=timeout)
    results, errors = [None] * n, [None] * n

    def body(r):
        try:
            results[r] = fn(r, world.comm(r))
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    for e in errors:
        if e is not None:
            raise e
    return results


def full_tensor(name, shape, dtype=torch.float32):
    """The same tensor for a name in every process: what ranks slice from and loaders compare to."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -2**31), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def assert_bitwise(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.numel():
        as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(as_bytes(a), as_bytes(b)), what


@pytest.fixture
def ranks():
    return run_ranks


@pytest.fixture
def full():
    return full_tensor


@pytest.fixture
def bitwise():
    return assert_bitwise
