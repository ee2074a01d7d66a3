"""Resharding throughput (Megatron TP=2 -> rollout) against a plain gloo all-gather plus copy of the
same bytes, same ranks, same run; and the peak extra memory of a sync.

    python benchmarks/bench_resharding.py              # 2 ranks, bucket 32 MB, 5 alternated repeats
    python benchmarks/bench_resharding.py --quick      # 2 repeats, inference TP 2 and 1 still both run
    python benchmarks/bench_resharding.py --bucket-mb 4 --repeats 7 --inference-tp 2

Model: Llama-style, 25.9M parameters (hidden 512, 8 heads, 4 KV heads, head_dim 64, 6 layers,
ffn 1408, vocab 8000, untied), random weights from verl_hpc.models.tiny, float32: 103.6 MB of HF
tensors. Two spawned gloo ranks hold it as Megatron TP=2 (verl_hpc.models.build_gpt_model).

Measured per repeat, in alternating order, each from a barrier and timed by the slowest rank:
  peer          dist.all_gather of the same total bytes in bucket-sized flat fp32 chunks (each rank
                contributes 1/TP) + torch.cat of the parts into one tensor: the transport bound
  peer-into     the same with dist.all_gather_into_tensor (no parts, no cat): for information
  sync-null     verl_hpc.resharding.sync into a NullSink: the whole resharding transport (TP
                all-gather per parameter, QKV / gate-up un-fusion, buckets), no inference engine
  sync-vllm     the same into the in-process VLLMRollout (its reload_weights + prefix-cache reset)
  vllm-reload   VLLMRollout.load_weights of the same tensors already gathered: vLLM's own cost
for inference TP 2 (one vLLM engine over both ranks) and TP 1 (one engine per rank, 2 replicas).
Printed: GB/s (HF bytes / seconds) and ratios sync / peer (goal >= 0.7). Then the peak extra
memory of one sync, per rank (verl_hpc.resharding.memory.HeapPeak: the process's C heap in use,
sampled every 0.2 ms, above its level before the call; separate untimed runs) against the
bucket plus the largest tensor, and the most the bucket itself held (counted in the code path).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1408, max_positions=512)
RANKS, TRAIN_TP = 2, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- rank side

def _timed(fn) -> float:
    """Seconds of fn() on the slowest rank, started from a barrier."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _peer(total_bytes: int, bucket_bytes: int, into: bool):
    """Flat fp32 send buffers, one per bucket-sized chunk of total_bytes (1/TP of it per rank)."""
    import torch
    import torch.distributed as dist

    tp = dist.get_world_size()
    chunks, left = [], total_bytes // 4
    while left > 0:
        n = min(bucket_bytes // 4, left)
        n -= n % tp
        chunks.append(torch.randn(max(n // tp, 1)))
        left -= max(n, tp)

    def run():
        for local in chunks:
            if into:
                out = torch.empty(local.numel() * tp)
                dist.all_gather_into_tensor(out, local)
            else:
                parts = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(parts, local)
                out = torch.cat(parts)  # the copy into one destination tensor
            del out
    return run


def _rank_main(workdir: Path) -> None:
    import torch
    import torch.distributed as dist

    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.parallel import init_model_parallel
    from verl_hpc.resharding import NullSink, sync
    from verl_hpc.resharding.memory import HeapPeak
    from verl_hpc.rollout.vllm_rollout import VLLMRollout
    from verl_hpc.runtime import bootstrap

    a = json.loads((workdir / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=600)
    rank0 = ctx.rank == 0

    def say(*parts):
        if rank0:
            print(*parts, flush=True)

    init_model_parallel(TRAIN_TP, 1, seed=1)
    model = build_gpt_model(load_arch(a["model"]))
    load_hf_weights(model, a["model"])
    bucket = int(a["bucket_mb"] * (1 << 20))
    weights = [(n, t.clone()) for n, t in sync_source(model)]
    total = sum(t.numel() * t.element_size() for _, t in weights)
    largest = max(t.numel() * t.element_size() for _, t in weights)
    gathered = sum(1 for p in model.parameters() if getattr(p, "tensor_model_parallel", False))
    say(f"HF tensors: {len(weights)} ({total / 1e6:.1f} MB, largest {largest / 1e6:.1f} MB); "
        f"Megatron TP={TRAIN_TP}: {gathered} TP all-gathers per export; bucket {a['bucket_mb']} MB")

    small = torch.zeros(1)
    lat = statistics.median(_timed(lambda: dist.all_gather([torch.empty(1) for _ in range(RANKS)], small))
                            for _ in range(50))
    say(f"gloo all_gather latency (1 element): {lat * 1e6:.0f} us -> {gathered} collectives "
        f"cost ~{gathered * lat * 1e3:.1f} ms per export in latency alone")

    ops = {"peer": _peer(total, bucket, into=False), "peer-into": _peer(total, bucket, into=True),
           "sync-null": lambda: sync(model, NullSink(), bucket_mb=a["bucket_mb"])}
    results = {}
    for inf_tp in a["inference_tp"]:
        engine = VLLMRollout(a["model"], tp=inf_tp, ctx=ctx, max_prompt_length=32,
                             max_response_length=32, kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
        runs = dict(ops)
        runs["sync-vllm"] = lambda: sync(model, engine, bucket_mb=a["bucket_mb"])
        runs["vllm-reload"] = lambda: engine.load_weights(iter(weights))
        for fn in runs.values():  # warm-up: first-call allocations and lazy inits apart
            _timed(fn)
        seconds = {k: [] for k in runs}
        for rep in range(a["repeats"]):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for k in order:
                seconds[k].append(_timed(runs[k]))
        med = {k: statistics.median(v) for k, v in seconds.items()}
        say(f"\ninference TP={inf_tp} ({RANKS // inf_tp} vLLM replica{'s' if inf_tp < RANKS else ''}), "
            f"median of {a['repeats']}:")
        for k, s in med.items():
            say(f"  {k:<12} {s * 1e3:8.1f} ms  {total / s / 1e9:6.2f} GB/s   "
                f"(runs: {', '.join(f'{x * 1e3:.0f}' for x in seconds[k])} ms)")
        ratio_null, ratio_vllm = med["peer"] / med["sync-null"], med["peer"] / med["sync-vllm"]
        say(f"  ratio sync-null / peer = {ratio_null:.2f}  (goal >= 0.7: "
            f"{'met' if ratio_null >= 0.7 else 'NOT met'})")
        say(f"  ratio sync-vllm / peer = {ratio_vllm:.2f}  (goal >= 0.7: "
            f"{'met' if ratio_vllm >= 0.7 else 'NOT met'}); vLLM's reload alone is "
            f"{med['vllm-reload'] / med['sync-vllm'] * 100:.0f}% of sync-vllm")
        say(f"  ratio sync-null / peer-into = {med['peer-into'] / med['sync-null']:.2f}")
        mem = {}
        for name, sink in (("null", NullSink()), ("vllm", engine)):
            with HeapPeak() as m:
                met = sync(model, sink, bucket_mb=a["bucket_mb"])
            peaks = torch.tensor([m.peak_bytes], dtype=torch.float64)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
            mem[name] = float(peaks.item())
            say(f"  peak extra memory, sync into {name:<4}: {mem[name] / 1e6:6.1f} MB = "
                f"{mem[name] / (min(bucket, total) + largest):.2f} x (bucket {min(bucket, total) / 1e6:.1f}"
                f" + largest {largest / 1e6:.1f} MB); held in the bucket at most "
                f"{met['sync/peak_bucket_bytes'] / 1e6:.1f} MB in {int(met['sync/buckets'])} buckets")
        results[inf_tp] = dict(seconds=seconds, median=med, memory=mem)
        engine.close()
    if rank0:
        (workdir / "results.json").write_text(json.dumps(dict(total_bytes=total, largest=largest,
                                                              results=results)))
    dist.barrier()
    dist.destroy_process_group()


def sync_source(model):
    from verl_hpc.models import export_hf_weights

    return export_hf_weights(model)


# ----------------------------------------------------------------------------- launcher side

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--inference-tp", type=int, nargs="+", default=[2, 1], choices=[1, 2])
    ap.add_argument("--rank-side", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rank_side:
        return _rank_main(Path(a.rank_side))
    if a.quick:
        a.repeats = 2
    from verl_hpc.models.tiny import make_tiny_model

    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_resharding_") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "llama26m", "llama", layers=6, vocab_size=8000, seed=0, **SHAPE)
        (work / "args.json").write_text(json.dumps(dict(model=str(model), bucket_mb=a.bucket_mb,
                                                        repeats=a.repeats, inference_tp=a.inference_tp)))
        port, procs = _free_port(), []
        for rank in range(RANKS):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", VERL_HPC_LOGLEVEL="WARNING", PYTHONWARNINGS="ignore",
                       VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR",
                       PYTHONPATH=str(REPO))
            env.pop("SLURM_JOB_ID", None)
            log = open(work / f"rank{rank}.log", "w")  # rank 0's stdout is the report
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-side", str(work)],
                                          env=env, cwd=REPO, stdout=None if rank == 0 else log,
                                          stderr=log if rank == 0 else subprocess.STDOUT))
        codes = [p.wait() for p in procs]
        if any(codes):
            for rank in range(RANKS):
                print(f"--- rank {rank} log tail\n" + (work / f"rank{rank}.log").read_text()[-3000:])
            raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
