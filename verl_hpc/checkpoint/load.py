"""Reading a checkpoint at any layout: a requested slab is assembled from whichever pieces meet it.

Loading is local (no collectives): each rank asks for its own slabs, opens only the files that
hold pieces intersecting them, and checks the checksum of every block it reads. Nothing is
unpickled: the index is JSON, tensors and rank state are raw HDF5 datasets.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Optional, Sequence

import torch

from verl_hpc.checkpoint import checksum, dtypes, index
from verl_hpc.checkpoint.comm import is_rank0
from verl_hpc.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointLayoutError,
                                        CheckpointNotFoundError)
from verl_hpc.checkpoint.plan import rank_file
from verl_hpc.checkpoint.progress import INTERVAL_S, Progress
from verl_hpc.checkpoint.rankfile import PieceHandle, open_h5, open_piece, read_region, verify_piece
from verl_hpc.checkpoint.rankfile import read_rank_state as _read_rank_state
from verl_hpc.checkpoint.sharded import ShardedTensor, intersect, volume


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    global_shape: tuple
    dtype: torch.dtype
    pieces: tuple  # index entries: {file, dataset, offsets, shape}


class CheckpointReader:
    """An opened checkpoint (a directory, or a root whose `latest` names one). Close it when done."""

    def __init__(self, path, *, progress_interval: float = INTERVAL_S) -> None:
        self.path = index.resolve(path)
        self.index = index.read_index(self.path)
        self.progress_interval = progress_interval
        self._sizes = {f["name"]: int(f["bytes"]) for f in self.index["files"]}
        self._files: dict = {}   # file name -> (h5py.File, fd)
        self._pieces: dict = {}  # (file, dataset) -> PieceHandle
        self._pool: Optional[checksum.CrcPool] = None

    # --------------------------------------------------------------------- what is in it
    @property
    def step(self) -> int:
        return int(self.index["step"])

    @property
    def world_size(self) -> int:
        return int(self.index["world_size"])

    @property
    def layout(self) -> Optional[dict]:
        return self.index.get("layout")

    @property
    def metadata(self) -> dict:
        return self.index["metadata"]

    def tensors(self) -> dict[str, TensorInfo]:
        return {n: TensorInfo(n, tuple(e["global_shape"]), dtypes.torch_dtype(e["dtype"]), tuple(e["pieces"]))
                for n, e in self.index["tensors"].items()}

    def info(self, name: str) -> TensorInfo:
        entry = self.index["tensors"].get(name)
        if entry is None:
            close = difflib.get_close_matches(name, list(self.index["tensors"]), n=3)
            raise CheckpointNotFoundError(f"no tensor {name!r} in {self.path} ({len(self.index['tensors'])} "
                                          f"tensors)" + (f"; did you mean {close}?" if close else ""))
        return TensorInfo(name, tuple(entry["global_shape"]), dtypes.torch_dtype(entry["dtype"]),
                          tuple(entry["pieces"]))

    # --------------------------------------------------------------------- files and pieces
    def _file(self, name: str, why: str):
        if name in self._files:
            return self._files[name]
        path = self._checked_path(name, why)
        self._files[name] = (self._open_h5(path, why), os.open(path, os.O_RDONLY))
        return self._files[name]

    def _checked_path(self, name: str, why: str):
        """The file's path, once it is listed in the index, present and of the size the index recorded."""
        path = self.path / name
        if name not in self._sizes:
            raise CheckpointCorruptError(f"{why}: file {name} is not listed in {self.path / index.INDEX}")
        if not path.exists():
            raise CheckpointNotFoundError(f"{why}: file {path} is missing from the checkpoint")
        size = path.stat().st_size
        if size != self._sizes[name]:
            raise CheckpointCorruptError(f"{why}: file {path} has {size} bytes but the index recorded "
                                         f"{self._sizes[name]} (truncated or replaced)")
        return path

    @staticmethod
    def _open_h5(path, why: str):
        try:
            return open_h5(path, "r")
        except OSError as e:
            raise CheckpointCorruptError(f"{why}: file {path} cannot be opened as HDF5: {e}") from None

    def check_files(self) -> None:
        """Every file the index lists is there, of the recorded size, and opens as HDF5: a stat and
        a header read per file, no data (`verify` reads and checksums the data). Opened files are
        closed at once, so a checkpoint of thousands of ranks does not hold thousands open."""
        for entry in self.index["files"]:
            why = f"rank {entry['rank']}"
            self._open_h5(self._checked_path(entry["name"], why), why).close()

    def _piece(self, tensor: str, entry: dict) -> PieceHandle:
        key = (entry["file"], entry["dataset"])
        if key not in self._pieces:
            f, fd = self._file(entry["file"], f"tensor {tensor!r}")
            full = dict(entry, dtype=self.index["tensors"][tensor]["dtype"])
            self._pieces[key] = open_piece(f, fd, str(self.path / entry["file"]), entry["dataset"], tensor, full)
        return self._pieces[key]

    def _crc_pool(self) -> checksum.CrcPool:
        if self._pool is None:
            self._pool = checksum.CrcPool()
        return self._pool

    # --------------------------------------------------------------------- reading
    def _fill(self, name: str, offsets: tuple, dest: torch.Tensor, progress: Progress) -> None:
        info = self.info(name)
        shape = tuple(dest.shape)
        if len(offsets) != len(info.global_shape) or any(
                o < 0 or o + n > g for o, n, g in zip(offsets, shape, info.global_shape)):
            raise CheckpointLayoutError(f"tensor {name!r}: slab offsets {list(offsets)} shape {list(shape)} "
                                        f"is outside its global shape {list(info.global_shape)}")
        covered = 0
        for entry in info.pieces:
            box = intersect(entry["offsets"], entry["shape"], offsets, shape)
            if box is None:
                continue
            lo, bshape = box
            h = self._piece(name, entry)
            view = dest[tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, offsets, bshape))]
            read_region(h, tuple(a - o for a, o in zip(lo, entry["offsets"])), bshape, view,
                        self._crc_pool(), progress)
            covered += volume(bshape)
        if covered != volume(shape):
            raise CheckpointNotFoundError(
                f"tensor {name!r}: the index's pieces cover {covered} of the {volume(shape)} elements at "
                f"offsets {list(offsets)} shape {list(shape)}; a piece is missing from {self.path / index.INDEX}")

    def _progress(self, what: str, nbytes: int) -> Progress:
        return Progress(f"checkpoint load step {self.step} ({what})", nbytes, enabled=is_rank0(),
                        interval=self.progress_interval)

    def load_tensor(self, name: str, offsets: Optional[Sequence[int]] = None,
                    shape: Optional[Sequence[int]] = None, *,
                    global_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The slab at `offsets` of `shape` (defaults: the whole tensor), in the stored dtype."""
        info = self.info(name)
        if global_shape is not None and tuple(global_shape) != info.global_shape:
            raise CheckpointLayoutError(f"tensor {name!r} has global shape {list(info.global_shape)} in "
                                        f"{self.path}, not {list(global_shape)}")
        offsets = tuple(offsets) if offsets is not None else (0,) * len(info.global_shape)
        shape = tuple(shape) if shape is not None else tuple(g - o for g, o in zip(info.global_shape, offsets))
        out = torch.empty(shape, dtype=info.dtype)
        self._fill(name, offsets, out, self._progress(name, out.numel() * out.element_size()))
        return out

    def load_into(self, targets: Sequence[ShardedTensor]) -> None:
        """Fill each target's local tensor in place from the checkpoint (any writer layout)."""
        for t in targets:
            info = self.info(t.name)
            if info.global_shape != tuple(t.global_shape) or info.dtype != t.local.dtype:
                raise CheckpointLayoutError(
                    f"tensor {t.name!r}: checkpoint has global shape {list(info.global_shape)} {info.dtype}, "
                    f"the target wants {list(t.global_shape)} {t.local.dtype}")
        total = sum(t.local.numel() * t.local.element_size() for t in targets)
        progress = self._progress(f"{len(targets)} tensors", total)
        for t in targets:
            self._fill(t.name, tuple(t.offsets), t.local, progress)

    def rank_state(self, rank: int) -> dict:
        if not 0 <= rank < self.world_size:
            raise CheckpointNotFoundError(f"{self.path} was written by {self.world_size} ranks; no rank {rank}")
        f, _ = self._file(rank_file(rank), f"rank state of rank {rank}")
        return _read_rank_state(f, str(self.path / rank_file(rank)))

    def verify(self) -> tuple[int, list[str]]:
        """Read and check every piece and every rank state; return (bytes checked, errors)."""
        errors, nbytes = [], 0
        progress = self._progress("verify", sum(self._sizes.values()))
        for name, info in self.tensors().items():
            if sum(volume(p["shape"]) for p in info.pieces) != volume(info.global_shape):
                errors.append(f"tensor {name!r}: pieces do not cover its global shape {list(info.global_shape)}")
            for entry in info.pieces:
                try:
                    h = self._piece(name, entry)
                    verify_piece(h, self._crc_pool(), progress)
                    nbytes += h.nbytes
                except CheckpointError as e:
                    errors.append(str(e))
        for rank in range(self.world_size):
            try:
                self.rank_state(rank)
            except CheckpointError as e:
                errors.append(str(e))
        return nbytes, errors

    def close(self) -> None:
        for f, fd in self._files.values():
            f.close()
            os.close(fd)
        self._files.clear()
        self._pieces.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(path) -> CheckpointReader:
    return CheckpointReader(path)


def _with_reader(ckpt, fn):
    if isinstance(ckpt, CheckpointReader):
        return fn(ckpt)
    with CheckpointReader(ckpt) as reader:
        return fn(reader)


def load_tensor(ckpt, name: str, global_shape=None, offsets=None, shape=None) -> torch.Tensor:
    return _with_reader(ckpt, lambda r: r.load_tensor(name, offsets, shape, global_shape=global_shape))


def load_into(ckpt, targets: Sequence[ShardedTensor]) -> None:
    _with_reader(ckpt, lambda r: r.load_into(targets))


def read_metadata(ckpt) -> dict:
    return _with_reader(ckpt, lambda r: r.metadata)


def read_rank_state(ckpt, rank: int) -> dict:
    return _with_reader(ckpt, lambda r: r.rank_state(rank))


def list_tensors(ckpt) -> dict[str, TensorInfo]:
    return _with_reader(ckpt, lambda r: r.tensors())


def checkpoint_step(ckpt) -> int:
    return _with_reader(ckpt, lambda r: r.step)


__all__ = ["CheckpointReader", "TensorInfo", "checkpoint_step", "list_tensors", "load_into", "load_tensor",
           "open_checkpoint", "read_metadata", "read_rank_state"]
