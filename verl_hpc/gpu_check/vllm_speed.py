"""The vLLM checks with figures (vllm_checks.py has the others and the list):

    vllm_weight_sync   the project's weight sync (resharding.WeightSync), full and sliced at tp 1, from
        the trained Megatron engine into vLLM, SYNC_ROUNDS times each with a train step between:
        seconds and GB/s of each, against the device's own copy rate for as many bytes (the bound a
        one-GPU sync cannot beat: every byte is read and written once); at every sync the served
        weights are read back where vLLM's forward reads them and compared bitwise with what the
        sync sent (resharding.check_served, every = 1), so the rollout serves the trainer's export
    vllm_ngram         n-gram speculation (rollout.speculative.method = ngram) against none on the
        same engine settings: greedy responses identical, tokens/s of each, the acceptance
    vllm_vs_hf         rollout tokens/s of vLLM (CUDA graphs, as a job on a GPU) against the project's
        HF generate engine, the same prompts, exact lengths (min_tokens = max_tokens)

The model is the kit's tiny Llama: the figures are the engines' overheads on a small model, not a
throughput claim for large ones (benchmarks/ has those).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List

from verl_hpc.gpu_check import workload
from verl_hpc.gpu_check.kit import Kit
from verl_hpc.gpu_check.vllm_checks import GRAPH_SEQS, PROMPTS, greedy, need_vllm, record, rollout

SYNC_ROUNDS = 3
SPEED_PROMPTS = 32
SPEED_TOKENS = 64
REHEARSAL_SHAPE = (8, 16)  # prompts, tokens: a CPU rehearsal tests the code, not the speed


def shape(kit: Kit):
    """(prompts, new tokens) of the speed checks."""
    return REHEARSAL_SHAPE if kit.rehearsal else (SPEED_PROMPTS, SPEED_TOKENS)


def copy_rate(nbytes: int, device) -> float:
    """Bytes/s of one device-to-device copy of `nbytes` (the median of five, after a warm-up)."""
    import torch

    from verl_hpc.runtime.device import synchronize as sync

    src = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def weight_sync(kit: Kit) -> str:
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.resharding import WeightSync

    need_vllm()
    engine = MegatronEngine(workload.train_options(workload.tiny_model(kit), kit.dtype, use_distributed_optimizer=True))
    r = rollout(kit, workload.tiny_model(kit))
    figures: Dict[str, List[Dict[str, float]]] = {}
    try:
        for mode in ("full", "sliced"):
            syncer = WeightSync(bucket_mb=64, mode=mode, check_served_every=1)
            figures[mode] = []
            for i in range(SYNC_ROUNDS):
                m = engine.train_step(workload.batch(10 + i), workload.loss_fn)
                assert m["nonfinite"] == 0.0, m
                got = syncer(engine, r)  # raises ServedWeightsError naming a tensor served otherwise
                assert got.get("sync/served_checked", 0) > 0 and not got.get("sync/served_unplaced"), got
                assert bool(got["sync/sliced"]) == (mode == "sliced"), got
                figures[mode].append({k: got[k] for k in ("sync/seconds", "sync/bytes", "sync/served_checked")})
            r.generate(PROMPTS[:2], greedy(4))  # the engine serves after the syncs
    finally:
        r.close()
    device = "cpu" if kit.rehearsal else "cuda"
    bound = copy_rate(int(figures["full"][0]["sync/bytes"]), device)
    parts = []
    for mode, rows in figures.items():
        sec = statistics.median(row["sync/seconds"] for row in rows)
        size = rows[0]["sync/bytes"]
        parts.append(f"{mode} {size / 1e6:.1f} MB in {sec * 1e3:.1f} ms = {size / sec / 1e9:.3g} GB/s "
                     f"({size / sec / bound:.2%} of the copy)")
    record(kit, "vllm_weight_sync", {"rounds": figures, "copy_bytes_per_s": bound, "device": device})
    checked = int(figures["sliced"][-1]["sync/served_checked"])
    return (f"{'; '.join(parts)}; the {device} copies at {bound / 1e9:.3g} GB/s; served weights read back "
            f"bitwise equal to the sync's after each of {SYNC_ROUNDS} syncs per mode ({checked} tensors)")


def _timed(generate, prompts, spec):
    """(tokens/s, result) of one call, after a warm-up call on the same prompts."""
    generate(prompts, spec)
    start = time.perf_counter()
    result = generate(prompts, spec)
    return result.num_response_tokens / (time.perf_counter() - start), result


def ngram(kit: Kit) -> str:
    """Prompts that repeat themselves, so that prompt lookup finds candidates; greedy, so that
    speculation must not change a token."""
    from verl_hpc.config.sections.speculative import SpeculativeConfig

    need_vllm()
    count, tokens = shape(kit)
    prompts = [list(range(10 + i, 18 + i)) * 4 for i in range(min(count, 8))]
    spec = greedy(tokens)
    out = {}
    # n-gram with the section's defaults (K, lookup lengths): what `method: ngram` gives a job
    for name, config in (("plain", None), ("ngram", SpeculativeConfig(method="ngram"))):
        r = rollout(kit, workload.tiny_model(kit), speculative=config, max_response_length=tokens)
        try:
            rate, result = _timed(r.generate, prompts, spec)
            counts = r.speculation_counts()
        finally:
            r.close()
        out[name] = dict(tokens_per_s=rate, responses=result.response_ids,
                         accepted=getattr(counts, "accepted", None), drafted=getattr(counts, "drafted", None))
    same = out["plain"]["responses"] == out["ngram"]["responses"]
    record(kit, "vllm_ngram", {k: {x: y for x, y in v.items() if x != "responses"} for k, v in out.items()})
    assert same, "n-gram speculation changed greedy responses"
    p, n = out["plain"]["tokens_per_s"], out["ngram"]["tokens_per_s"]
    acc = out["ngram"]
    accepted = f"; accepted {acc['accepted']} of {acc['drafted']} drafted" if acc["drafted"] is not None else ""
    return (f"greedy identical over {len(prompts)} prompts x {tokens} tokens; {n:.0f} tokens/s with "
            f"n-gram vs {p:.0f} without ({n / p:.2f}x){accepted}")


def vs_hf(kit: Kit) -> str:
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.hf.engine import HFRollout
    from verl_hpc.rollout.sampling import default_spec

    need_vllm()
    count, tokens = shape(kit)
    prompts = [[(7 * i + j) % 400 + 5 for j in range(32)] for i in range(count)]
    spec = default_spec(temperature=1.0, max_tokens=tokens, min_tokens=tokens, seed=3)
    path = workload.tiny_model(kit)
    rates = {}
    # graphs on a GPU, capture sizes as vllm_graphs_reload's
    r = rollout(kit, path, max_response_length=tokens, enforce_eager=kit.rehearsal, max_num_seqs=GRAPH_SEQS)
    try:
        rates["vllm"], a = _timed(r.generate, prompts, spec)
    finally:
        r.close()
    hf = HFRollout(path, **default_engine_args("hf", dtype=kit.dtype, max_prompt_length=64,
                                               max_response_length=tokens))
    rates["hf"], b = _timed(hf.generate, prompts, spec)
    hf = None
    assert a.num_response_tokens == b.num_response_tokens == count * tokens, \
        (a.num_response_tokens, b.num_response_tokens)
    record(kit, "vllm_vs_hf", dict(rates, prompts=count, tokens=tokens, dtype=kit.dtype))
    return (f"{count} prompts x {tokens} tokens, {kit.dtype}: vLLM {rates['vllm']:.0f} tokens/s, "
            f"HF generate {rates['hf']:.0f} ({rates['vllm'] / rates['hf']:.1f}x)")
