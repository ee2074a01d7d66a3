"""vllm_graphs_reload: CUDA graphs after weight reloads, every GPU job's default (`rollout.enforce_eager:
auto` compiles and captures on a GPU) and the one path no other check reloads.

A CUDA graph replays the kernels it captured on the addresses it captured: the weights and the KV
cache must be where they were at the capture. A reload (`reload_weights`) copies into the same
parameters, and a level-2 sleep frees their memory and the wake maps it again at the same
virtual addresses (vLLM's cumem allocator): if either moved a tensor, the graphs would read freed
or stale memory and the engine would generate from other weights than those synced. So: an engine
with graphs, synced twice from the Megatron engine with a train step between, asleep at level 2,
woken and synced again (the trainer's order), generates greedily; an eager engine, built fresh
and synced once with the same weights, generates the same prompts. Verdict:
- the graph engine's log-probs of its tokens against the training engine's on the same tokens
  (the trainer's mismatch metric) within the bf16 bound: stale weights would be far outside it;
- its greedy tokens equal the eager engine's, but where the eager engine's two best tokens are
  within TIE_NATS at the first difference of a row (a bf16 near-tie that the compiled kernels may
  break the other way: counted and reported, not a failure).
The eager engine reports raw log-probs and also draws with top-k/top-p: vLLM's default sampler,
which asks for FlashInfer on CUDA unless the engine environment says not to (it is not in the kit).
In a CPU rehearsal vLLM compiles with Inductor (no graphs on a CPU) and has no sleep mode: the code
runs, the figures are not a GPU's.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

from verl_hpc.gpu_check import workload
from verl_hpc.gpu_check.kit import Kit
from verl_hpc.gpu_check.vllm_checks import GRAPH_SEQS, NEW_TOKENS, PROMPTS, bound, greedy, mismatch, need_vllm, record, rollout

TIE_NATS = 0.05  # two best tokens this close in bf16 may swap between compiled and eager kernels
SYNCS = 2
DROPPED = 2  # the sleep level that drops the weights and maps their memory again: what is checked


def first_difference(got: Sequence[int], want: Sequence[int]) -> int:
    """The first position where two token lists differ (len of the shorter where one extends the
    other), or -1 where they are equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return -1 if len(got) == len(want) else min(len(got), len(want))


def token_verdict(graph_rows: List[List[int]], eager_rows: List[List[int]], gaps: List[List[float]]) -> Dict:
    """{"identical", "ties", "problems"} of the graph engine's greedy rows against the eager ones;
    `gaps[r][i]`: the eager engine's log-prob gap between its two best tokens at position i of row r."""
    out = {"identical": 0, "ties": 0, "problems": []}
    for r, (g, e) in enumerate(zip(graph_rows, eager_rows)):
        i = first_difference(g, e)
        if i < 0:
            out["identical"] += 1
        elif i < len(gaps[r]) and gaps[r][i] < TIE_NATS:
            out["ties"] += 1
        else:
            gap = f"{gaps[r][i]:.3g}" if i < len(gaps[r]) else "n/a"
            out["problems"].append(f"row {r}: greedy tokens differ from the eager engine's at position {i} "
                                   f"(the eager engine's two best differ by {gap} nats >= {TIE_NATS})")
    return out


def _eager_rows_with_gaps(r, prompts, max_tokens: int):
    """Greedy rows of the eager engine and, per position, its two best tokens' log-prob gap (vLLM's
    own top-2 log-probs: the project's rollout asks for the sampled token's only)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    outs = r.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rows, gaps = [], []
    for out in outs:
        seq = out.outputs[0]
        rows.append(list(seq.token_ids))
        best = [sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in seq.logprobs]
        gaps.append([b[0] - b[1] if len(b) > 1 else float("inf") for b in best])
    return rows, gaps


def graphs_reload(kit: Kit) -> str:
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.resharding import WeightSync
    from verl_hpc.rollout.sampling import default_spec
    from verl_hpc.rollout.vllm import environment

    need_vllm()
    path = workload.tiny_model(kit)
    engine = MegatronEngine(workload.train_options(path, kit.dtype, use_distributed_optimizer=True))
    syncer = WeightSync(bucket_mb=64, mode="full", check_served_every=1)
    graphs = rollout(kit, path, enforce_eager=False, max_num_seqs=GRAPH_SEQS, sleep_between_phases=True, sleep_level=DROPPED)
    try:
        for i in range(SYNCS):  # the trainer's phase: a step, the weights woken, synced, the KV cache woken
            m = engine.train_step(workload.batch(30 + i), workload.loss_fn)
            assert m["nonfinite"] == 0.0, m
            graphs.wake(tags=("weights",))
            syncer(engine, graphs)
            graphs.wake()
            graphs.generate(PROMPTS[:2], greedy(4))  # replays graphs between the reloads
            graphs.sleep()  # level 2: the weights and the KV cache dropped, mapped again at the wake
        graphs.wake(tags=("weights",))
        syncer(engine, graphs)
        graphs.wake()
        got = graphs.generate(PROMPTS, greedy())
        drift = mismatch(got, engine)
    finally:
        graphs.close()
    # raw log-probs and a top-k/top-p draw: vLLM's default sampler, which imports FlashInfer on CUDA
    # unless the project's engine environment turns it off (rollout/vllm/environment.py)
    eager = rollout(kit, path, enforce_eager=True, max_num_seqs=GRAPH_SEQS, logprobs_mode="raw")
    try:
        syncer(engine, eager)
        want, gaps = _eager_rows_with_gaps(eager, PROMPTS, NEW_TOKENS)
        drawn = eager.generate(PROMPTS[:2], default_spec(temperature=1.0, top_k=20, top_p=0.9, max_tokens=4, seed=1))
    finally:
        eager.close()
    assert drawn.num_response_tokens > 0
    verdict = token_verdict([list(r) for r in got.response_ids], want, gaps)
    record(kit, "vllm_graphs_reload", {"mismatch": drift, "tokens": verdict,
                                      "syncs": SYNCS + 1, "sleep_level": DROPPED, "max_num_seqs": GRAPH_SEQS,
                                      "engine_environment": {k: os.environ.get(k) for k in environment.engine_environment({})}})
    problems = list(verdict["problems"])
    if drift["rollout/logprob_diff_max"] >= bound(kit):
        problems.insert(0, f"after the reloads the graph engine's log-probs differ from the training engine's by "
                           f"{drift['rollout/logprob_diff_max']:.3g} >= {bound(kit)} (stale weights in its graphs?)")
    assert not problems, "; ".join(problems)
    return (f"graphs after {SYNCS + 1} syncs and {SYNCS} level-2 sleeps: greedy tokens equal an eager engine's in "
            f"{verdict['identical']} of {len(PROMPTS)} rows ({verdict['ties']} near-ties < {TIE_NATS} nats); "
            f"log-probs vs the training engine max {drift['rollout/logprob_diff_max']:.3g} (bound {bound(kit)})")
