"""Checkpoint save/load bandwidth against raw sequential file I/O of the same bytes, same disk, same run.

    python benchmarks/bench_checkpoint.py                 # 2 ranks x 512 MB, 5 alternated repeats
    python benchmarks/bench_checkpoint.py --quick         # 2 ranks x 64 MB, 1 repeat
    python benchmarks/bench_checkpoint.py --ranks 2 --mb-per-rank 1024 --dir /scratch/me

Each rank (spawned, gloo) holds `--tensors` row-split slabs of global tensors (fp32 and bf16),
`--mb-per-rank` MB in all. Per repeat, in alternating order:
  raw write   each rank os.write()s its bytes to one new file, fsync    | peer of
  ckpt save   save_checkpoint (HDF5 file per rank + index, CRC32, fsyncs, rename, latest)
              (both start with no old copy to delete and no dirty pages: rm + sync before each)
  raw read    each rank readinto()s its file into the target tensors    | peer of
  ckpt load   CheckpointReader.load_into the same targets (same layout, checksums verified)
Reads follow a drop of the page cache (echo 3 > /proc/sys/vm/drop_caches) when the process may do
it; the output says whether it could. Times run from a barrier to a barrier (the slowest rank).
Then: a cross-layout load (column halves of row-split pieces), and an AsyncSaver's blocking time
against the synchronous save. Printed: GB/s and the ratios ckpt/raw (goal >= 0.7).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHUNK = 64 << 20


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def make_tensors(rank, world, mb, n):
    import torch

    from verl_hpc.checkpoint import ShardedTensor

    per = mb * (1 << 20) // n
    out = []
    g = torch.Generator().manual_seed(rank)
    for k in range(n):
        dtype = torch.float32 if k % 2 == 0 else torch.bfloat16
        cols = 1024
        rows = per // (cols * torch.empty((), dtype=dtype).element_size())
        local = torch.randn(rows, cols, generator=g).to(dtype)
        out.append(ShardedTensor(f"layers.{k}.weight", local, (rows * world, cols), (rows * rank, 0)))
    return out


def raw_write(path, tensors):
    from verl_hpc.checkpoint.dtypes import as_bytes

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            mv = memoryview(as_bytes(t.local))
            pos = 0
            while pos < len(mv):
                pos += os.write(fd, mv[pos:pos + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path, targets):
    from verl_hpc.checkpoint.dtypes import as_bytes

    with open(path, "rb", buffering=0) as f:
        for t in targets:
            mv = memoryview(as_bytes(t.local))
            pos = 0
            while pos < len(mv):
                pos += f.readinto(mv[pos:pos + CHUNK])


def worker(rank, world, port, args, workdir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VERL_HPC_LOGLEVEL="WARNING")
    import torch
    import torch.distributed as dist

    from verl_hpc.checkpoint import AsyncSaver, ShardedTensor, open_checkpoint, save_checkpoint
    from verl_hpc.runtime import bootstrap

    bootstrap(backend="gloo", num_threads=1)
    tensors = make_tensors(rank, world, args.mb_per_rank, args.tensors)
    targets = [ShardedTensor(t.name, torch.empty_like(t.local), t.global_shape, t.offsets) for t in tensors]
    total = world * sum(t.local.numel() * t.local.element_size() for t in tensors)
    root, raw = Path(workdir) / "ckpt", Path(workdir) / "raw"
    if rank == 0:
        raw.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def cold():
        ok = drop_caches() if rank == 0 else True
        flag = torch.tensor([int(ok)])
        dist.broadcast(flag, 0)
        return bool(flag.item())

    times = {k: [] for k in ("raw write", "ckpt save", "raw read", "ckpt load")}
    dropped = True
    for rep in range(args.repeats):
        order = ("raw", "ckpt") if rep % 2 == 0 else ("ckpt", "raw")
        for kind in order:
            # both start from the same state: no old copy to delete, no dirty pages of the other
            if kind == "raw":
                (raw / f"rank{rank}.bin").unlink(missing_ok=True)
            elif rank == 0:
                shutil.rmtree(root, ignore_errors=True)
            dist.barrier()
            os.sync()
            if kind == "raw":
                times["raw write"].append(timed(lambda: raw_write(raw / f"rank{rank}.bin", tensors)))
            else:
                times["ckpt save"].append(timed(lambda: save_checkpoint(root, rep, tensors)))
        for kind in order:
            dropped &= cold()
            if kind == "raw":
                times["raw read"].append(timed(lambda: raw_read(raw / f"rank{rank}.bin", targets)))
            else:
                def load():
                    with open_checkpoint(root) as ckpt:
                        ckpt.load_into(targets)
                times["ckpt load"].append(timed(load))
                assert all(torch.equal(a.local, b.local) for a, b in zip(tensors, targets)), "load differs"

    # a reader layout no writer had: column halves of every row-split tensor
    cols = [ShardedTensor(t.name, torch.empty(t.global_shape[0], t.global_shape[1] // world, dtype=t.local.dtype),
                          t.global_shape, (0, rank * t.global_shape[1] // world)) for t in tensors]
    dropped &= cold()

    def load_cols():
        with open_checkpoint(root) as ckpt:
            ckpt.load_into(cols)
    t_cols = timed(load_cols)

    # async: how long save() holds the caller (1st call allocates snapshot buffers, later ones reuse)
    saver = AsyncSaver(Path(workdir) / "ckpt_async", keep_last=1, timeout_s=600)
    blocked, commit = [], []
    for k in range(2):
        os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        saver.save(k, tensors)
        blocked.append(time.perf_counter() - t0)
        saver.wait()
        commit.append(time.perf_counter() - t0)
    held = torch.tensor(blocked + commit)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if rank == 0:
        report(args, world, total, times, dropped, t_cols, held.tolist())
    dist.barrier()
    dist.destroy_process_group()


def report(args, world, total, times, dropped, t_cols, held):
    med = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: total / v / 1e9 for k, v in med.items()}
    print(f"\ncheckpoint benchmark: {world} ranks x {args.mb_per_rank} MB in {args.tensors} tensors "
          f"({total / 1e9:.2f} GB), {args.repeats} alternated repeat(s), dir {args.dir}")
    print(f"page cache dropped before reads: {'yes' if dropped else 'NO - reads may come from memory'}")
    for k in times:
        runs = " ".join(f"{total / t / 1e9:.2f}" for t in times[k])
        print(f"  {k:<10} {gbs[k]:6.2f} GB/s  (median of {runs})")
    print(f"  save ratio  ckpt/raw = {gbs['ckpt save'] / gbs['raw write']:.2f}   (goal >= 0.7)")
    print(f"  load ratio  ckpt/raw = {gbs['ckpt load'] / gbs['raw read']:.2f}   (goal >= 0.7)")
    print(f"  cross-layout load (column halves of row-split pieces): {total / t_cols / 1e9:.2f} GB/s "
          f"= {total / t_cols / 1e9 / gbs['raw read']:.2f} x raw read")
    b1, b2, c1, c2 = held
    print(f"  async save: caller held {b1:.3f} s (1st, allocates the snapshot) / {b2:.3f} s (reused buffers) "
          f"vs sync save {med['ckpt save']:.3f} s = {b2 / med['ckpt save']:.3f} of it; "
          f"commit after {c2:.3f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mb-per-rank", type=int, default=512)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (the disk under test)")
    p.add_argument("--quick", action="store_true", help="64 MB per rank, 1 repeat")
    args = p.parse_args()
    if args.quick:
        args.mb_per_rank, args.repeats = 64, 1
    import torch.multiprocessing as mp

    workdir = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(worker, args=(args.ranks, port, args, workdir), nprocs=args.ranks, join=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
