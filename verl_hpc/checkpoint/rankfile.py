"""One rank's HDF5 file: HDF5 for the layout and attributes, plain pwrite/pread for the bulk bytes.

    /                      attrs: format, version, rank, world_size, step
    /tensors/<name>        one dataset per piece this rank writes (a 2nd piece of the same tensor
                           on this rank is `<name>#1`, ...); attrs: name, global_shape, offsets,
                           dtype, crc32, crc32_block_bytes
    /rank_state/<key>      this rank's RNG states etc.: numeric arrays, or uint8 with kind=bytes

Datasets are contiguous and unfiltered, so `h5ls`/`h5dump`/h5py read them like any other file.
Big ones (>= RAW_MIN bytes) are created with their space allocated up front and no fill; their
bytes then go straight to the file offset HDF5 gave them with os.pwrite, while a helper thread
computes the block CRCs. Reads use os.preadv into the destination tensor's own memory. Both
syscalls release the GIL (h5py holds it for a whole H5Dwrite), which is what lets an async save
write in the background without stalling the training thread, and they add no copy.
"""
from __future__ import annotations

import dataclasses
import os

import h5py
import numpy as np
import torch

from verl_hpc.checkpoint import checksum, dtypes
from verl_hpc.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError
from verl_hpc.checkpoint.progress import Progress

FORMAT, VERSION = "verl_hpc.checkpoint", 1
RAW_MIN = 64 << 10        # smaller datasets are written through h5py with their data
CHUNK = 64 << 20          # bytes per pwrite/preadv call; a multiple of checksum.BASE_BLOCK
FILE_KW = dict(libver=("earliest", "v110"),  # readable by HDF5 1.10 tools (Debian's h5ls)
               alignment_threshold=RAW_MIN, alignment_interval=4096)


def open_h5(path, mode: str = "r") -> h5py.File:
    """h5py.File without HDF5's file locking: Lustre mounted without flock fails every locked
    open, and a reader opening a file that a writer holds gets errno 11 (docs/platform-notes.md,
    "HDF5"). Files are only read after their atomic publish, so the lock protects nothing here. Outside this
    package (h5ls, h5dump, user scripts) set HDF5_USE_FILE_LOCKING=FALSE for the same reason."""
    kw = FILE_KW if mode == "w" else {}
    try:
        return h5py.File(path, mode, locking=False, **kw)
    except ValueError:  # h5py built on HDF5 < 1.12.1 has no locking argument
        os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")
        return h5py.File(path, mode, **kw)


@dataclasses.dataclass
class PieceToWrite:
    dataset: str           # path inside the file, e.g. "tensors/decoder.final_layernorm.weight"
    name: str
    tensor: torch.Tensor   # CPU, contiguous
    global_shape: tuple
    offsets: tuple


def _create(f: h5py.File, path: str, data: np.ndarray, attrs: dict, raw: bool) -> h5py.Dataset:
    if raw:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # a file offset to pwrite to, now
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)    # no zeros written first
        ds = f.create_dataset(path, shape=data.shape, dtype=data.dtype, dcpl=dcpl)
    else:
        ds = f.create_dataset(path, data=data)
    for k, v in attrs.items():
        ds.attrs[k] = v
    return ds


def _pwrite_all(fd: int, buf: np.ndarray, offset: int, progress: Progress) -> None:
    mv = memoryview(buf).cast("B")
    pos = 0
    while pos < len(mv):
        n = os.pwrite(fd, mv[pos:pos + CHUNK], offset + pos)
        pos += n
        progress.add(n)


def write_rank_file(path, pieces: list[PieceToWrite], rank_state: dict, file_attrs: dict,
                    progress: Progress) -> int:
    """Write, fsync and close one rank's file; return its size in bytes."""
    raw_jobs = []
    with open_h5(path, "w") as f, checksum.CrcPool() as pool:
        for k, v in file_attrs.items():
            f.attrs[k] = v
        for p in pieces:
            buf = dtypes.as_bytes(p.tensor)
            block = checksum.block_bytes_for(buf.nbytes)
            raw = buf.nbytes >= RAW_MIN
            attrs = dict(name=p.name, global_shape=np.asarray(p.global_shape, np.int64),
                         offsets=np.asarray(p.offsets, np.int64), dtype=dtypes.dtype_name(p.tensor.dtype),
                         crc32_block_bytes=np.int64(block),
                         crc32=(np.zeros(checksum.n_blocks(buf.nbytes, block), np.uint32) if raw
                                else checksum.block_crcs(buf, block)))
            ds = _create(f, p.dataset, dtypes.as_storage_array(p.tensor), attrs, raw)
            if raw:
                raw_jobs.append((ds, buf, pool.submit(buf, block)))  # CRC runs during the writes
            else:
                progress.add(buf.nbytes)
        for key, value in rank_state.items():
            is_bytes = isinstance(value, (bytes, bytearray))
            arr = np.frombuffer(bytes(value), np.uint8) if is_bytes else np.ascontiguousarray(value)
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"rank_state[{key!r}]: numeric arrays or bytes only, got dtype {arr.dtype}")
            _create(f, f"rank_state/{key}", arr, dict(
                kind="bytes" if is_bytes else "array", crc32_block_bytes=np.int64(checksum.BASE_BLOCK),
                crc32=checksum.block_crcs(arr.reshape(-1).view(np.uint8), checksum.BASE_BLOCK)), raw=False)
        f.flush()
        fd = os.open(path, os.O_RDWR)
        try:
            for ds, buf, crc in raw_jobs:
                offset = ds.id.get_offset()
                if offset is None:  # HDF5 did not allocate up front: let it write the data itself
                    ds[...] = buf.view(ds.dtype).reshape(ds.shape)
                    progress.add(buf.nbytes)
                else:
                    _pwrite_all(fd, buf, offset, progress)
            for ds, _, crc in raw_jobs:
                ds.attrs.modify("crc32", crc.result())
            f.close()
            os.fsync(fd)
        finally:
            os.close(fd)
    return os.path.getsize(path)


# ----------------------------------------------------------------------------- reading

@dataclasses.dataclass
class PieceHandle:
    """An opened piece: where its bytes are and what they must checksum to."""

    tensor: str
    file: str
    dataset: str
    ds: h5py.Dataset
    fd: int
    offset: int | None    # byte offset of the contiguous data in the file; None: read via h5py
    shape: tuple
    dtype: torch.dtype
    itemsize: int
    nbytes: int
    block: int
    crcs: np.ndarray
    whole: np.ndarray | None = None  # bytes read through h5py, when offset is None

    def where(self) -> str:
        return f"tensor {self.tensor!r} (file {self.file}, dataset {self.dataset})"


def open_piece(f: h5py.File, fd: int, file: str, dataset: str, tensor: str, entry: dict) -> PieceHandle:
    """Open a piece the index names, checking the file says the same thing as the index."""
    try:
        ds = f[dataset]
    except KeyError:
        raise CheckpointNotFoundError(f"tensor {tensor!r}: dataset {dataset} missing from file {file}") from None
    a = ds.attrs
    try:
        seen = (a["name"], [int(x) for x in a["offsets"]], list(ds.shape), a["dtype"])
        crcs, block = np.asarray(a["crc32"], np.uint32).reshape(-1), int(a["crc32_block_bytes"])
    except KeyError as e:
        raise CheckpointCorruptError(f"tensor {tensor!r}: dataset {dataset} in {file} lacks attribute {e}") from None
    want = (tensor, list(entry["offsets"]), list(entry["shape"]), entry["dtype"])
    if seen != want:
        raise CheckpointCorruptError(
            f"tensor {tensor!r}: index and file disagree for dataset {dataset} in {file}: "
            f"index says (name, offsets, shape, dtype)={want}, file says {seen}")
    dt = dtypes.torch_dtype(entry["dtype"])
    itemsize = torch.empty((), dtype=dt).element_size()
    nbytes = itemsize * int(np.prod(ds.shape, dtype=np.int64))
    if block <= 0 or block % itemsize or len(crcs) != checksum.n_blocks(nbytes, block):
        raise CheckpointCorruptError(f"{tensor!r}: bad checksum attributes on dataset {dataset} in {file}")
    return PieceHandle(tensor, file, dataset, ds, fd, ds.id.get_offset() if nbytes else None,
                       tuple(ds.shape), dt, itemsize, nbytes, block, crcs)


def _pread_into(h: PieceHandle, start: int, view: np.ndarray) -> None:
    if h.offset is None:  # small, or not contiguous (e.g. repacked by h5repack): HDF5 reads it
        if h.whole is None:
            h.whole = np.ascontiguousarray(h.ds[()]).reshape(-1).view(np.uint8)
        view[:] = h.whole[start:start + len(view)]
        return
    pos = 0
    while pos < len(view):
        n = os.preadv(h.fd, [view[pos:]], h.offset + start + pos)
        if n == 0:
            raise CheckpointCorruptError(f"{h.where()}: file ends before the dataset's bytes (truncated copy?)")
        pos += n


def _check(h: PieceHandle, first_block: int, got: np.ndarray) -> None:
    bad = np.flatnonzero(got != h.crcs[first_block:first_block + len(got)])
    if len(bad):
        b = first_block + int(bad[0])
        raise CheckpointCorruptError(
            f"checksum mismatch in {h.where()}: bytes [{b * h.block}, {min((b + 1) * h.block, h.nbytes)}) "
            f"of {h.nbytes} (block {b} of {len(h.crcs)}) do not match the stored crc32")


def _read_verified(h: PieceHandle, start: int, stop: int, buf: np.ndarray, pool, progress: Progress) -> None:
    """Bytes [start, stop) of the piece (block-aligned start) into buf, checked block by block; the
    checksum of one chunk runs on the pool while the next chunk is read."""
    chunk = max(h.block, CHUNK // h.block * h.block)
    pending = []
    for pos in range(start, stop, chunk):
        view = buf[pos - start:min(pos + chunk, stop) - start]
        _pread_into(h, pos, view)
        pending.append((pos // h.block, pool.submit(view, h.block)))
        progress.add(len(view))
    for first, fut in pending:
        _check(h, first, fut.result())


def read_region(h: PieceHandle, lo: tuple, shape: tuple, dest: torch.Tensor, pool, progress: Progress) -> None:
    """Copy the box at `lo` (piece coordinates) of `shape` into `dest` (same shape, any strides)."""
    if h.nbytes == 0:
        return
    strides = [int(np.prod(h.shape[d + 1:], dtype=np.int64)) for d in range(len(h.shape))]
    first = sum(l * s for l, s in zip(lo, strides))
    last = sum((l + n - 1) * s for l, n, s in zip(lo, shape, strides))
    start = first * h.itemsize // h.block * h.block           # widen to whole checksum blocks
    stop = min(-(-(last + 1) * h.itemsize // h.block) * h.block, h.nbytes)
    whole = tuple(lo) == (0,) * len(lo) and tuple(shape) == h.shape
    if whole and dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == h.dtype:
        _read_verified(h, 0, h.nbytes, dtypes.as_bytes(dest), pool, progress)  # straight into dest
        return
    buf = np.empty(stop - start, np.uint8)
    _read_verified(h, start, stop, buf, pool, progress)
    flat = torch.from_numpy(buf).view(h.dtype)
    src = torch.as_strided(flat, shape, strides, (first * h.itemsize - start) // h.itemsize)
    dest.copy_(src)


def verify_piece(h: PieceHandle, pool, progress: Progress) -> None:
    """Read every byte of a piece and check it, through two reused buffers (bounded memory)."""
    chunk = max(h.block, CHUNK // h.block * h.block)
    bufs = [np.empty(min(chunk, h.nbytes), np.uint8) for _ in range(2)]
    pending: list = [None, None]  # per buffer: (first block, crc future) still using it
    for i, pos in enumerate(range(0, h.nbytes, chunk)):
        if pending[i % 2] is not None:
            _check(h, pending[i % 2][0], pending[i % 2][1].result())
        view = bufs[i % 2][:min(chunk, h.nbytes - pos)]
        _pread_into(h, pos, view)
        pending[i % 2] = (pos // h.block, pool.submit(view, h.block))
        progress.add(len(view))
    for p in pending:
        if p is not None:
            _check(h, p[0], p[1].result())


def read_rank_state(f: h5py.File, file: str) -> dict:
    out = {}
    group = f.get("rank_state")
    for key in (group.keys() if group is not None else []):
        ds = group[key]
        arr = np.ascontiguousarray(ds[()])
        got = checksum.block_crcs(arr.reshape(-1).view(np.uint8), int(ds.attrs["crc32_block_bytes"]))
        if not np.array_equal(got, np.asarray(ds.attrs["crc32"], np.uint32).reshape(-1)):
            raise CheckpointCorruptError(f"checksum mismatch in rank state {key!r} (file {file}, dataset {ds.name})")
        out[key] = arr.tobytes() if ds.attrs.get("kind") == "bytes" else arr
    return out
