"""torch's fused AdamW against its foreach AdamW on CPU: the optimizer step alone.

    python benchmarks/bench_adam.py [--threads 2] [--steps 15]

The FSDP engine builds the fused one (engines/fsdp/optim.py); this is what that choice measures on
CPU. Parameters of the benchmarks' reference shape (docs/benchmarks.md: hidden 512, 6 layers, ffn
1408, vocab 8000, untied: 27.5M in 57 tensors), random gradients, weight decay 0.01. The two
optimizers step alternately (the order swapped each step) after one warm-up step each (their
states); medians; prints foreach / fused.
"""
from __future__ import annotations

import argparse
import statistics
import time

SHAPES = [(8000, 512)] * 2 + [(512, 512)] * 24 + [(1408, 512)] * 18 + [(512,)] * 13


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    opts, times = {}, {}
    for name, kw in (("fused", dict(fused=True)), ("foreach", dict(foreach=True))):
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        for p in params:
            p.grad = torch.randn_like(p)
        opts[name] = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kw)
        opts[name].step()  # warm-up: the states
        times[name] = []
    for i in range(a.steps):
        for name in (("fused", "foreach") if i % 2 == 0 else ("foreach", "fused")):
            t = time.perf_counter()
            opts[name].step()
            times[name].append(time.perf_counter() - t)
    n = sum(torch.Size(s).numel() for s in SHAPES)
    fused, foreach = statistics.median(times["fused"]), statistics.median(times["foreach"])
    print(f"AdamW step, {n / 1e6:.1f}M parameters, {a.threads} threads: fused {fused * 1e3:.1f} ms, "
          f"foreach {foreach * 1e3:.1f} ms; foreach / fused = {foreach / fused:.2f}x")


if __name__ == "__main__":
    main()
