"""The output layer at a Qwen-sized vocabulary on CPU: peak memory and time of the log-prob pass and
of one update, chunked (model.logits_chunk_tokens = auto) against the whole logits (= 0), both engines.

    python benchmarks/bench_logits.py [--responses 512,4096] [--rows 2] [--whole-up-to 512]
                                      [--repeats 3] [--threads 2] [--out benchmarks/results/logits.json]

Model: a one-layer Llama with hidden 64 (2 heads of 32, 1 KV head, ffn 128) and V = 151,936, random
weights, fp32, so that the output layer is what costs: `rows` rows of a 16-token prompt and a
`responses`-token response, one micro-batch. Each (engine, length, mode) runs in its own process
(one gloo rank, `--threads` threads), with glibc's mmap threshold fixed so that freed blocks leave
the resident set (runtime/memory_peaks.py, benchmarks/bench_sp_memory.py say why):
- log-prob pass: `engine.forward(batch, ("log_probs", "entropy"))`;
- update: `engine.train_step` with a loss that reads log-probs and entropy (both outputs' gradients),
  after one warm-up update, so that Adam's states exist before the measured one.
Peak = the resident high-water mark during one call after the warm-up minus the resident set at its
start; time = the median of `--repeats` calls after the warm-up, in a second process with glibc's
defaults (the fixed threshold makes every large block fault its pages in again).

The whole-logits path holds several [tokens, V] fp32 copies at once (2 x 4,096 tokens: 5 GB each):
beyond `--whole-up-to` response tokens per row it is not run on a shared 24 GiB machine; its peak
there is extrapolated linearly in tokens from the longest measured length (the copies are linear
in tokens; the rest is small), and marked so. Ratios: whole / chunked peak (goal >= 4 at
2 x 4,096), chunked / whole time (goal <= 1.1).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB, PROMPT = 151936, 16
SHAPE = dict(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, max_positions=32768)
MMAP_THRESHOLD = 128 << 10


def measure(folder: str, engine: str, rows: int, response: int, chunk: int, repeats: int, threads: int,
            kind: str) -> dict:
    """One process's measurement (see the module docstring): kind "memory" (1 measured call) or
    "time" (the median of `repeats`)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.batch import get_response_mask, pack_sequences
    from verl_hpc.engines.options import default_options
    from verl_hpc.runtime.memory_peaks import HostPeaks

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, VOCAB, (PROMPT,), generator=g).tolist() for _ in range(rows)]
    resps = [torch.randint(5, VOCAB, (response,), generator=g).tolist() for _ in range(rows)]
    batch = pack_sequences(prompts, resps)
    batch["response_mask"] = get_response_mask(batch)
    o = default_options(folder, engine=engine, optim=OptimConfig(lr=1e-4), micro_batch_size=rows, total_steps=10,
                        logits_chunk_tokens=chunk, temperature=1.0)
    if engine == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        eng = FsdpEngine(o)
    else:
        from verl_hpc.engines.megatron import MegatronEngine
        from verl_hpc.parallel import init_model_parallel

        init_model_parallel(1, 1)
        eng = MegatronEngine(o)

    def loss(out, mb, counts):
        m = mb["response_mask"]
        return -((out["log_probs"] + 0.01 * out["entropy"]) * m).sum() / counts.tokens, {}

    probe = HostPeaks()
    result = {}
    for phase, call in (("logprob", lambda: eng.forward(batch, ("log_probs", "entropy"))),
                        ("update", lambda: eng.train_step(batch, loss, ("log_probs", "entropy")))):
        call()  # warm-up (and Adam's states)
        times, rises = [], []
        for _ in range(repeats if kind == "time" else 1):
            probe.reset()
            start = probe.current()
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
            rises.append(probe.peak() - start)
        result[phase] = {"seconds": statistics.median(times), "peak_bytes": max(rises)}
    return result


def run_one(folder, engine, rows, response, chunk, repeats, threads) -> dict:
    """Memory in one process (glibc's mmap threshold fixed: every large block freed leaves the
    resident set, and every new one is faulted in again, which slows it), time in another (glibc's
    defaults, as a job runs)."""
    out = {}
    for kind in ("memory", "time"):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
                   VERL_HPC_LOGLEVEL="WARNING")
        if kind == "memory":
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        args = json.dumps([folder, engine, rows, response, chunk, repeats, threads, kind])
        proc = subprocess.run([sys.executable, __file__, "--child", args], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} response {response} chunk {chunk} failed:\n{proc.stderr[-3000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        for phase, v in got.items():
            out.setdefault(phase, {})["peak_bytes" if kind == "memory" else "seconds"] = (
                v["peak_bytes"] if kind == "memory" else v["seconds"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--responses", default="512,4096")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--whole-up-to", type=int, default=512, help="longest response the whole-logits path runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="fsdp,megatron")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "logits.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(*json.loads(a.child))))
        return
    from verl_hpc.config.sections.model import logits_chunk_size
    from verl_hpc.models.tiny import make_tiny_model

    folder = str(make_tiny_model(Path(tempfile.mkdtemp()) / "wide", "llama", layers=1, vocab_size=VOCAB, **SHAPE))
    lengths = [int(x) for x in a.responses.split(",")]
    print(f"V = {VOCAB}, hidden {SHAPE['hidden']}, {a.rows} rows x ({PROMPT} + R) tokens, chunk auto = "
          f"{logits_chunk_size(None, VOCAB)} tokens, {a.threads} threads; peak = resident rise during the call")
    report = {"vocab": VOCAB, "rows": a.rows, "chunk": logits_chunk_size(None, VOCAB), "runs": []}
    for engine in a.engines.split(","):
        whole_at = {}
        for r in lengths:
            chunked = run_one(folder, engine, a.rows, r, None, a.repeats, a.threads)
            whole, extrapolated = None, False
            if r <= a.whole_up_to:
                whole = whole_at[r] = run_one(folder, engine, a.rows, r, 0, a.repeats, a.threads)
            elif whole_at:
                base = max(whole_at)
                whole = {ph: {"peak_bytes": v["peak_bytes"] * r / base, "seconds": None}
                         for ph, v in whole_at[base].items()}
                extrapolated = True
            for phase in ("logprob", "update"):
                c = chunked[phase]
                row = {"engine": engine, "response": r, "phase": phase, "chunked_peak_mib": c["peak_bytes"] / 2**20,
                       "chunked_s": c["seconds"]}
                line = (f"{engine:9s} 2x{r:<6d} {phase:8s} chunked {c['peak_bytes'] / 2**20:8.0f} MiB "
                        f"{c['seconds']:7.3f} s")
                if whole is not None:
                    w = whole[phase]
                    row.update(whole_peak_mib=w["peak_bytes"] / 2**20, whole_s=w["seconds"],
                               whole_extrapolated=extrapolated,
                               peak_ratio=w["peak_bytes"] / max(c["peak_bytes"], 1))
                    line += (f" | whole {w['peak_bytes'] / 2**20:8.0f} MiB{' (extrapolated)' if extrapolated else ''}"
                             f" -> peak whole/chunked {row['peak_ratio']:5.1f}x")
                    if w["seconds"]:
                        row["time_ratio"] = c["seconds"] / w["seconds"]
                        line += f", time chunked/whole {row['time_ratio']:.2f}x"
                print(line, flush=True)
                report["runs"].append(row)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
