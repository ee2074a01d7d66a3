"""LoRA's adapter-only weight sync against the full (merged) sync of the same actor, same run.

    python benchmarks/bench_lora_sync.py              # rank 16, 3 alternated repeats
    python benchmarks/bench_lora_sync.py --repeats 5 --rank 16
    python benchmarks/bench_lora_sync.py --steps 3    # sync + generation per mode (lora.sync auto's rule)

Model: the ~100M benchmark Llama of bench_vs_trl.py (12 layers, hidden 768, 12 heads, 4 KV heads,
head_dim 64, ffn 2560, vocab 8000, untied; 102M parameters), random weights, float32, one rank.
The Megatron actor holds rank-`--rank` adapters on (a) all four targets (QKV, output projection,
fc1, fc2) and (b) the attention targets only (QKV, output projection); one in-process vLLM engine
with LoRA enabled takes both syncs:

  full      resharding.WeightSync: the merged weights (W + alpha/r B A) into vLLM's load_weights
  adapter   resharding.AdapterSync: the PEFT-named adapter tensors into vLLM's LoRA slot

Printed per target set: bytes sent and seconds (median), the adapter/full ratios, and the same
byte ratio for a Llama-3-70B shape from the adapter's shapes alone (no tensors). The adapter's
bytes over the full weights' bytes is r * (in + out) / (in * out) summed over the targets, so it
falls with the model's width: the 1% goal holds at this width for the attention targets, and for
all four targets from a few thousand hidden units up.

`--steps N` measures what `lora.sync: auto` decides between, the sync and the generation that
follows it, each mode on the engine a job builds for it: merged = a vLLM engine without LoRA slots
taking the merged weights, adapter = one with a LoRA slot taking the adapter and generating through
vLLM's LoRA kernels. A random non-zero adapter on all four targets; per step the adapter's version
moves, it is synced and `--prompts` prompts of 16 tokens get `--tokens` tokens each (exact lengths).
One vLLM engine at a time: `--rounds` rounds, each building merged's engine and adapter's (in
alternating order, so that a machine's drift hits both alike), N timed steps after one untimed.
`--model smollm135m` uses SmolLM2-135M's shape instead of the 102M Llama.
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
SHAPE = dict(hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=2560, max_positions=512)
LAYERS, VOCAB = 12, 8000
# --steps --model smollm135m: SmolLM2-135M's shape (30 narrow layers, tied 49152-token vocabulary)
SMOLLM = dict(layers=30, vocab_size=49152, tied=True, hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536,
              max_positions=512)
TARGET_SETS = {"all": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
               "attention": ("linear_qkv", "linear_proj")}


def adapter_bytes_by_shape(arch, rank: int, targets, dtype_bytes: int = 4) -> int:
    """Bytes of the PEFT-format adapter of `arch` (what the sync sends), from shapes alone."""
    from verl_hpc.models.lora_names import factor_hf_entries

    total = 0
    for layer in range(arch.num_layers):
        for t in targets:
            for factor in "AB":
                for _, shape in factor_hf_entries(arch, t, factor, layer, rank):
                    total += shape[0] * shape[1] * dtype_bytes
    return total


def full_bytes_by_shape(arch, dtype_bytes: int = 4) -> int:
    from verl_hpc.models.weight_rules import expected_hf_tensors

    total = 0
    for shape in expected_hf_tensors(arch).values():
        n = 1
        for d in shape:
            n *= d
        total += n * dtype_bytes
    return total


def _world(tmp: Path):
    import torch.distributed as dist

    from verl_hpc.parallel import init_model_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    init_model_parallel(1, 1)


def measure(model: Path, rank: int, repeats: int) -> dict:
    from verl_hpc.config.schema import LoraConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.resharding import AdapterSync, WeightSync
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.vllm.engine import VLLMRollout

    rollout = VLLMRollout(str(model), **default_engine_args("vllm", max_prompt_length=64, max_response_length=32),
                          lora_rank=rank)
    out = {}
    try:
        for name, targets in TARGET_SETS.items():
            eng = MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(
                rank=rank, alpha=2.0 * rank, target_modules=list(targets))))
            runs = {"full": [], "adapter": []}
            syncs = {"full": WeightSync(bucket_mb=64), "adapter": AdapterSync()}
            for kind in ("full", "adapter"):  # untimed: vLLM's first reload and LoRA load warm up
                eng.steps_applied += 1
                syncs[kind](eng, rollout)
            for _ in range(repeats):
                for kind in ("full", "adapter"):  # alternated: drift hits both alike
                    eng.steps_applied += 1  # a new adapter version each time, as after a step
                    runs[kind].append(syncs[kind](eng, rollout))
            row = {}
            for kind, ms in runs.items():
                row[kind] = {"bytes": ms[-1]["sync/bytes"],
                             "seconds": statistics.median(m["sync/seconds"] for m in ms)}
            row["bytes_ratio"] = row["adapter"]["bytes"] / row["full"]["bytes"]
            row["time_ratio"] = row["adapter"]["seconds"] / row["full"]["seconds"]
            out[name] = row
            del eng
    finally:
        rollout.close()
    return out


def measure_steps(model: Path, rank: int, steps: int, prompts: int, tokens: int, rounds: int, vocab: int) -> dict:
    import torch

    from verl_hpc.config.schema import LoraConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.models.lora import adapter_parameters
    from verl_hpc.resharding import AdapterSync, WeightSync
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec
    from verl_hpc.rollout.vllm.engine import VLLMRollout

    eng = MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(rank=rank, alpha=2.0 * rank)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B = 0 would still run the LoRA kernels; non-zero is what a trained one is
        for p in adapter_parameters(eng.gpt_chunks):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    batch = [torch.randint(5, vocab - 5, (16,), generator=g).tolist() for _ in range(prompts)]
    spec = default_spec(n=1, temperature=1.0, max_tokens=tokens, min_tokens=tokens, seed=1)
    rows = {"merged": [], "adapter": []}
    for r in range(rounds):
        for mode in (("merged", "adapter") if r % 2 == 0 else ("adapter", "merged")):
            rollout = VLLMRollout(str(model), **default_engine_args(
                "vllm", max_prompt_length=16, max_response_length=tokens, max_num_seqs=prompts),
                lora_rank=rank if mode == "adapter" else 0)
            sync = AdapterSync() if mode == "adapter" else WeightSync(bucket_mb=64)
            try:
                for step in range(steps + 1):  # the first is untimed: vLLM's first reload / LoRA load
                    eng.steps_applied += 1
                    t0 = time.perf_counter()
                    sync(eng, rollout)
                    t1 = time.perf_counter()
                    result = rollout.generate(batch, spec)
                    t2 = time.perf_counter()
                    assert sum(len(x) for x in result.response_ids) == prompts * tokens
                    if step:
                        rows[mode].append((t1 - t0, t2 - t1))
            finally:
                rollout.close()
    out = {}
    for mode, got in rows.items():
        out[mode] = {"sync_s": statistics.median(x[0] for x in got),
                     "generate_s": statistics.median(x[1] for x in got)}
        out[mode]["step_s"] = out[mode]["sync_s"] + out[mode]["generate_s"]
    out["adapter_over_merged"] = out["adapter"]["step_s"] / out["merged"]["step_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="measure sync + generation per mode instead")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", choices=("llama102m", "smollm135m"), default="llama102m")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.json = a.json or str(REPO / "benchmarks" / "results" / ("lora_steps.json" if a.steps else "lora_sync.json"))
    from verl_hpc.models.config_mapping import load_arch
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.planning.model_shape import known_arch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shape = SMOLLM if a.model == "smollm135m" else dict(layers=LAYERS, vocab_size=VOCAB, **SHAPE)
        model = make_tiny_model(tmp / a.model, "llama", seed=0, **shape)
        _world(tmp)
        t0 = time.time()
        if a.steps:
            measured = measure_steps(model, a.rank, a.steps, a.prompts, a.tokens, a.rounds, shape["vocab_size"])
            return _report_steps(a, measured, t0)
        measured = measure(model, a.rank, a.repeats)
        arch = load_arch(model)
    big = known_arch("llama-3-70b")
    shapes = {name: {"102m": adapter_bytes_by_shape(arch, a.rank, t) / full_bytes_by_shape(arch),
                     "llama-3-70b": adapter_bytes_by_shape(big, a.rank, t, 2) / full_bytes_by_shape(big, 2)}
              for name, t in TARGET_SETS.items()}
    print(f"LoRA rank {a.rank}, 102M Llama, 1 rank, {a.repeats} repeats (median), {time.time() - t0:.0f} s")
    print(f"{'targets':10} {'full MB':>9} {'full s':>8} {'adapter MB':>11} {'adapter s':>10} "
          f"{'bytes':>8} {'time':>7} {'70B bytes':>10}")
    for name, r in measured.items():
        print(f"{name:10} {r['full']['bytes'] / 1e6:9.1f} {r['full']['seconds']:8.3f} "
              f"{r['adapter']['bytes'] / 1e6:11.2f} {r['adapter']['seconds']:10.3f} "
              f"{100 * r['bytes_ratio']:7.2f}% {r['time_ratio']:6.3f}x {100 * shapes[name]['llama-3-70b']:9.2f}%")
    result = {"rank": a.rank, "repeats": a.repeats, "measured": measured, "by_shape": shapes}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"written: {a.json}")
    return 0


def _report_steps(a, r: dict, t0: float) -> int:
    from verl_hpc.runtime.device import describe_accelerator

    print(f"LoRA rank {a.rank}, {a.model}, all targets, {a.prompts} prompts x {a.tokens} tokens, "
          f"{a.rounds} rounds x {a.steps} steps (median), {describe_accelerator()}, {time.time() - t0:.0f} s")
    print(f"{'lora.sync':10} {'sync s':>8} {'generate s':>11} {'step s':>8}")
    for mode in ("merged", "adapter"):
        print(f"{mode:10} {r[mode]['sync_s']:8.3f} {r[mode]['generate_s']:11.3f} {r[mode]['step_s']:8.3f}")
    print(f"adapter / merged: {r['adapter_over_merged']:.2f}x")
    result = {"model": a.model, "rank": a.rank, "prompts": a.prompts, "tokens": a.tokens, "steps": a.steps,
              "rounds": a.rounds,
              "accelerator": describe_accelerator(), "measured": r}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"written: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
