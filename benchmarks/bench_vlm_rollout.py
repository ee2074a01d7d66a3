"""Image rollout throughput: vLLM's own Qwen-VL class (VLLMRollout) against HF generate (HFRollout, the
rollout `make demo-vlm` uses where vLLM cannot serve the model) on the same prompts and pictures, same run.

    python benchmarks/bench_vlm_rollout.py                      # the demo's shape: 16 prompts x n=16 x 8 tokens
    python benchmarks/bench_vlm_rollout.py --model outputs/demo_vlm/sft/hf --data outputs/demo_vlm/data/val.parquet
    python benchmarks/bench_vlm_rollout.py --new-tokens 64 --repeats 3

Runs in the vLLM-range venv (.venv-vllm025: torchvision beside vLLM; docs/vlm.md). Model: --model, a
vision-language folder (default: a fresh tiny Qwen2.5-VL, verl_hpc/models/tiny_vlm.py, --family);
prompts: the first --prompts rows of --data, a visual-task parquet (default: made here with
`python -m verl_hpc.data.prepare visual`), through the job's own data path (the model's processor).
Sampling: temperature 1, min_tokens = max_tokens = --new-tokens, so both engines write exactly as many
tokens. After one warm-up call each, the engines alternate per repeat; medians printed, with tokens/s of
each and the ratio vllm / hf from this one run.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prompts_of(model: str, data: str, count: int):
    """(token ids, PromptImages) of the first `count` rows, as the trainer makes them."""
    import pyarrow.parquet as pq

    from verl_hpc.data.processor import ImagePrompts, VisionProcessor

    prompts = ImagePrompts(VisionProcessor.load(model))
    ids, media = [], []
    for row in pq.read_table(data).slice(0, count).to_pylist():
        _, tokens, m = prompts.encode(row["prompt"], row["images"], str(Path(data).parent))
        ids.append(tokens)
        media.append(m)
    return ids, media


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a vision-language model folder (default: a fresh tiny one)")
    ap.add_argument("--family", default="qwen2_5_vl", help="the tiny model's family when --model is not given")
    ap.add_argument("--data", default=None, help="a visual-task parquet (default: made here)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per call (the demo's train batch)")
    ap.add_argument("--n", type=int, default=16, help="samples per prompt (the demo's rollout.n)")
    ap.add_argument("--new-tokens", type=int, default=8, help="tokens per sample (the demo's max_response_length)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)

    from verl_hpc.rollout import HFRollout, VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec

    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("load average at start: %.1f %.1f %.1f on %d CPUs" % (*os.getloadavg(), os.cpu_count()))
    tmp = tempfile.TemporaryDirectory(prefix="bench_vlm_rollout_")
    model = a.model
    if model is None:
        from verl_hpc.models.tiny_vlm import make_tiny_vlm

        model = str(make_tiny_vlm(Path(tmp.name) / a.family, a.family))
    data = a.data
    if data is None:
        subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "visual", f"{tmp.name}/data", "--n-train", "16",
                        "--n-val", str(a.prompts), "--kinds", "colour"], check=True, capture_output=True)
        data = f"{tmp.name}/data/val.parquet"
    ids, media = prompts_of(model, data, a.prompts)
    longest = max(len(p) for p in ids)
    spec = default_spec(n=a.n, temperature=1.0, max_tokens=a.new_tokens, min_tokens=a.new_tokens, seed=0)
    tokens = len(ids) * a.n * a.new_tokens
    args = dict(max_prompt_length=longest, max_response_length=a.new_tokens)
    start = time.perf_counter()
    vllm = VLLMRollout(model, max_num_seqs=max(256, len(ids) * a.n), **default_engine_args("vllm", **args))
    vllm_startup = time.perf_counter() - start
    start = time.perf_counter()
    hf = HFRollout(model, batch_size=len(ids), **default_engine_args("hf", **args))
    hf_startup = time.perf_counter() - start
    params = sum(p.numel() for p in hf.model.parameters())
    images = sum(len(m) for m in media if m is not None)
    print(f"model: {model} ({params / 1e6:.2f}M params, float32); {len(ids)} prompts (<= {longest} tokens, "
          f"{images} images) x n={a.n} x {a.new_tokens} new tokens = {tokens} tokens per call")
    print(f"start-up: vLLM engine {vllm_startup:.1f} s (vllm import included), HF model {hf_startup:.1f} s")

    def run(engine):
        result = engine.generate(ids, spec, media=media)
        assert result.num_response_tokens == tokens, result.num_response_tokens

    runs = {"vllm": lambda: run(vllm), "hf": lambda: run(hf)}
    warm = default_spec(n=1, temperature=1.0, max_tokens=2, min_tokens=2)
    for engine in (vllm, hf):
        engine.generate(ids[:2], warm, media=media[:2])
    seconds = {name: [] for name in runs}
    for rep in range(a.repeats):
        for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
            print(f"  repeat {rep + 1} {name:<5} {seconds[name][-1]:7.2f} s {tokens / seconds[name][-1]:8.0f} tok/s",
                  flush=True)
    rate = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    for name, r in rate.items():
        print(f"{name:<5} {r:8.0f} tok/s (median of {a.repeats})")
    print(f"vllm / hf: {rate['vllm'] / rate['hf']:.2f}x")
    print("load average at end: %.1f %.1f %.1f" % os.getloadavg())
    vllm.close()


if __name__ == "__main__":
    main()
