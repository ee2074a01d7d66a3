"""Where vLLM's own weight reload spends its time: the part of a resharding sync that is not the
transport (bench_resharding.py's vllm-reload row), against a plain copy of the same bytes.

    python benchmarks/profile_vllm_reload.py             # 5 timed reloads, then 3 under cProfile
    python benchmarks/profile_vllm_reload.py --top 15

Model: bench_resharding.py's 25.9M-parameter Llama (103.6 MB of fp32 HF tensors), one process,
inference TP 1, one torch thread. Timed: VLLMRollout.load_weights (vLLM's layer-wise
reload_weights + the tied-head refresh + reset_prefix_cache) with the full tensors already in
memory; the peer is tensor.copy_ of the same tensors into preallocated ones (the memcpy bound).
Then the cost centres by own time (cProfile), grouped: oneDNN weight pre-packing (vLLM's CPU GEMM
path re-packs every linear weight after each load; there is no such step on GPU), the tensor
copies, and the rest (vLLM's layer-wise reload bookkeeping in Python).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_rollout import build_model  # noqa: E402  (same model as the other benchmarks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model")
        engine = VLLMRollout(str(path), max_num_seqs=8,
                             **default_engine_args("vllm", max_prompt_length=64, max_response_length=16))
        state = load_file(f"{path}/model.safetensors")
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        dst = {k: torch.empty_like(v) for k, v in state.items()}

        def reload():
            engine.load_weights(iter(state.items()))

        def copy():
            for k, v in state.items():
                dst[k].copy_(v)

        for fn in (reload, copy):  # warm-up
            fn()
        times = {"reload": [], "copy": []}
        for _ in range(args.repeats):  # alternated, so drift hits both alike
            for name, fn in (("reload", reload), ("copy", copy)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{nbytes / 1e6:.1f} MB of HF tensors, median of {args.repeats}:")
        print(f"  vLLM load_weights  {med['reload'] * 1e3:8.1f} ms  {nbytes / med['reload'] / 1e9:6.2f} GB/s")
        print(f"  plain copy_        {med['copy'] * 1e3:8.1f} ms  {nbytes / med['copy'] / 1e9:6.2f} GB/s"
              f"   (reload / copy time: {med['reload'] / med['copy']:.1f}x)")

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            reload()
        prof.disable()
        engine.close()
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())
    groups = {"oneDNN weight pre-packing": 0.0, "tensor copies": 0.0, "the rest (Python)": 0.0}
    for (file, _, func), v in stats.items():
        if "onednn" in func or "dnnl" in func:
            groups["oneDNN weight pre-packing"] += v[2]
        elif func in ("<method 'copy_' of 'torch._C.TensorBase' objects>",):
            groups["tensor copies"] += v[2]
        else:
            groups["the rest (Python)"] += v[2]
    print(f"cProfile of 3 reloads ({total:.3f} s of own time):")
    for name, t in groups.items():
        print(f"  {name:28s} {100 * t / total:5.1f}%")
    print(f"top {args.top} by own time:")
    for (file, line, func), v in sorted(stats.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"  {100 * v[2] / total:5.1f}%  {v[1]:5d} calls  {func}  ({Path(file).name}:{line})")


if __name__ == "__main__":
    main()
