"""What the served-weights check (resharding.check_served) adds to a weight sync, same run.

    python benchmarks/bench_served_check.py              # 102M Llama, 5 alternated repeats
    python benchmarks/bench_served_check.py --repeats 3 --threads 2

Model: the ~100M benchmark Llama of bench_vs_trl.py (12 layers, hidden 768, 12 heads, 4 KV heads,
head_dim 64, ffn 2560, vocab 8000, untied; 102M parameters), random weights, float32, one rank, a
Megatron actor and one in-process vLLM engine. Two WeightSyncs of the same actor into the same engine,
alternated: one reads back every sync (check_served_every = 1), one never does. Printed: the median
sync without the check, the check's own read-back (sync/served_seconds: vLLM's linear layers probed
through their repacked copies, every tensor's CRC-32) and the sync's time with the check (which holds
the digests of what was sent), as ratios to the plain sync. A job pays the read-back at its first sync
and every check_served_every-th (default 100): the per-sync average is the ratio over that interval.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAPE = dict(layers=12, vocab_size=8000, hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=2560, max_positions=512)


def measure(model: Path, repeats: int) -> dict:
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.resharding import WeightSync
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.vllm.engine import VLLMRollout

    rollout = VLLMRollout(str(model), **default_engine_args("vllm", max_prompt_length=64, max_response_length=32))
    eng = MegatronEngine(default_options(model_path=str(model)))
    syncs = {"plain": WeightSync(bucket_mb=64), "checked": WeightSync(bucket_mb=64, check_served_every=1)}
    runs = {k: [] for k in syncs}
    try:
        for kind in syncs:  # untimed: vLLM's first reload warms up
            syncs[kind](eng, rollout)
        for _ in range(repeats):
            for kind in syncs:  # alternated: drift hits both alike
                t0 = time.perf_counter()
                metrics = syncs[kind](eng, rollout)
                runs[kind].append((time.perf_counter() - t0, metrics))
    finally:
        rollout.close()
    plain = statistics.median(t for t, _ in runs["plain"])
    checked = statistics.median(t for t, _ in runs["checked"])
    read_back = statistics.median(m["sync/served_seconds"] for _, m in runs["checked"])
    last = runs["checked"][-1][1]
    return {"plain_s": plain, "checked_s": checked, "read_back_s": read_back,
            "tensors": last["sync/served_checked"], "unplaced": last["sync/served_unplaced"],
            "bytes": last["sync/bytes"], "checked_over_plain": checked / plain,
            "read_back_over_plain": read_back / plain}


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "served_check.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from bench_lora_sync import _world

    from verl_hpc.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_tiny_model(tmp / "llama102m", "llama", seed=0, **SHAPE)
        _world(tmp)
        t0 = time.time()
        r = measure(model, a.repeats)
    print(f"served-weights check, 102M Llama, 1 rank, {a.threads} thread(s), {a.repeats} repeats (median), "
          f"{time.time() - t0:.0f} s")
    print(f"  sync without the check  {r['plain_s']:.3f} s ({r['bytes'] / 1e6:.0f} MB)")
    print(f"  sync with the check     {r['checked_s']:.3f} s = {r['checked_over_plain']:.2f}x")
    print(f"  of which the read-back  {r['read_back_s']:.3f} s = {r['read_back_over_plain']:.2f}x of a plain sync "
          f"({r['tensors']:.0f} tensors, {r['unplaced']:.0f} unplaced)")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(dict(r, threads=a.threads, repeats=a.repeats), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
