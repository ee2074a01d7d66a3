"""Rollout throughput: in-process vLLM (VLLMRollout) against HF `generate` on the same model, same run.

    python benchmarks/bench_rollout.py            # 64 prompts x 32 tokens, n=4, 128 new tokens, 2 repeats
    python benchmarks/bench_rollout.py --quick    # 16 prompts, n=2, 32 new tokens, 1 repeat
    python benchmarks/bench_rollout.py --prompts 64 --n 4 --new-tokens 128 --repeats 3 --threads 1
    python benchmarks/bench_rollout.py --shape 102m --prompts 8 --n 8 --new-tokens 24 --prompt-len 12

Models (--shape): Llama-style, random weights (matrices N(0, 0.02)) from verl_hpc.models.tiny,
float32, vocab 8000. 26m (default): 25.9M parameters, hidden 512, 8 heads, 4 KV heads, head_dim 64,
6 layers, ffn 1408. 102m: bench_vs_trl.py's 100m model, hidden 768, 12 heads, 4 KV heads, 12
layers, ffn 2560. Prompts: random token ids, --prompt-len each (default 32). Sampling:
temperature 1, min_tokens = max_tokens, so that every sequence has exactly --new-tokens tokens on
both sides (HF's min_new_tokens masks EOS the same way).

Measured, after one warm-up call each, in alternating order per repeat (medians printed):
  vllm       VLLMRollout.generate: the project's rollout (per-token logprobs included)
  hf         model.generate(num_return_sequences=n): plain transformers, the peer of the goal
  hf-rollout HFRollout.generate: the project's fallback (adds logprob recording)
Printed: tokens/s of each and the ratio vllm / hf (goal >= 2x). Engine start-up is reported apart.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name: (layers, make_tiny_model shape)
    "26m": (6, dict(hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1408, max_positions=512)),
    "102m": (12, dict(hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=2560, max_positions=512)),
}


def build_model(folder: Path, shape: str) -> Path:
    from verl_hpc.models.tiny import make_tiny_model

    layers, dims = SHAPES[shape]
    return make_tiny_model(folder, "llama", layers=layers, vocab_size=8000, seed=0, **dims)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 prompts, n=2, 32 new tokens, 1 repeat")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="26m", help="model shape (see above)")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    ap.add_argument("--no-hf-rollout", action="store_true", help="skip the HFRollout figure")
    ap.add_argument("--no-hf-generate", action="store_true",
                    help="skip plain HF generate (only vLLM against HFRollout, the two rollout engines)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for both engines (0: torch's default); 1 is steadier on a "
                         "machine shared with other jobs")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.n, a.new_tokens, a.repeats = 16, 2, 32, 1

    import torch

    from verl_hpc.rollout import HFRollout, VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec

    if a.threads > 0:
        torch.set_num_threads(a.threads)  # before vLLM: its CPU worker would otherwise keep it
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("load average at start: %.1f %.1f %.1f on %d CPUs" % (*os.getloadavg(), os.cpu_count()))
    tmp = tempfile.TemporaryDirectory(prefix="bench_rollout_")
    path = build_model(Path(tmp.name) / f"llama{a.shape}", a.shape)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 8000, (a.prompts, a.prompt_len), generator=gen).tolist()
    spec = default_spec(n=a.n, temperature=1.0, max_tokens=a.new_tokens, min_tokens=a.new_tokens,
                        seed=0)
    tokens = a.prompts * a.n * a.new_tokens

    start = time.perf_counter()
    vllm = VLLMRollout(str(path), max_num_seqs=max(256, a.prompts * a.n),
                       **default_engine_args("vllm", max_prompt_length=a.prompt_len, max_response_length=a.new_tokens))
    vllm_startup = time.perf_counter() - start
    start = time.perf_counter()
    hf_rollout = HFRollout(str(path), batch_size=a.prompts, **default_engine_args(
        "hf", max_prompt_length=a.prompt_len, max_response_length=a.new_tokens))
    hf_startup = time.perf_counter() - start
    model = hf_rollout.model
    params = sum(p.numel() for p in model.parameters())
    print(f"model: llama {params / 1e6:.1f}M params, float32, torch threads "
          f"{torch.get_num_threads()}; {a.prompts} prompts x {a.prompt_len} tokens x n={a.n} x "
          f"{a.new_tokens} new tokens = {tokens} tokens per call")
    print(f"start-up: vLLM engine {vllm_startup:.1f} s (vllm import included), "
          f"HF model {hf_startup:.1f} s")

    ids = torch.tensor(prompts)
    hf_kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                     top_p=1.0, num_return_sequences=a.n, max_new_tokens=a.new_tokens,
                     min_new_tokens=a.new_tokens, pad_token_id=model.config.pad_token_id)

    def run_vllm():
        result = vllm.generate(prompts, spec)
        assert result.num_response_tokens == tokens, result.num_response_tokens

    def run_hf():
        with torch.no_grad():
            out = model.generate(ids, **hf_kwargs)
        assert out.shape == (a.prompts * a.n, a.prompt_len + a.new_tokens), out.shape

    def run_hf_rollout():
        result = hf_rollout.generate(prompts, spec)
        assert result.num_response_tokens == tokens, result.num_response_tokens

    runs = {"vllm": run_vllm}
    if not a.no_hf_generate:
        runs["hf"] = run_hf
    if not a.no_hf_rollout:
        runs["hf-rollout"] = run_hf_rollout
    warm = default_spec(n=1, temperature=1.0, max_tokens=4, min_tokens=4)
    vllm.generate(prompts[:4], warm)
    hf_rollout.generate(prompts[:4], warm)
    with torch.no_grad():
        model.generate(ids[:4], **{**hf_kwargs, "attention_mask": torch.ones_like(ids[:4]),
                                   "max_new_tokens": 4, "min_new_tokens": 4})
    seconds = {name: [] for name in runs}
    for rep in range(a.repeats):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
            print(f"  repeat {rep + 1} {name:<10} {seconds[name][-1]:7.2f} s "
                  f"{tokens / seconds[name][-1]:8.0f} tok/s", flush=True)
    rate = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    for name, r in rate.items():
        print(f"{name:<10} {r:8.0f} tok/s (median of {a.repeats})")
    if "hf" in rate:
        ratio = rate["vllm"] / rate["hf"]
        print(f"ratio vllm / hf generate = {ratio:.2f}x (goal >= 2x: {'met' if ratio >= 2 else 'NOT met'})")
    if "hf-rollout" in rate:
        print(f"ratio vllm / HFRollout  = {rate['vllm'] / rate['hf-rollout']:.2f}x")
    print("load average at end: %.1f %.1f %.1f (figures are only comparable on a quiet machine)"
          % os.getloadavg())
    vllm.close()
    tmp.cleanup()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
