"""Per-rank activation memory of a GRPO job under Ulysses sequence parallelism, measured against
the memory plan.

    python benchmarks/bench_sp_memory.py [--out DIR] [--length 3884]

Three one-step GRPO jobs on 2 local ranks (FSDP engine, HF rollout, 1 thread a rank), a 4-layer
hidden-512 Llama (8 heads, 4 KV heads, vocab 500), 4 rows a step in micro-batches of one row:
- long, fsdp.sp = 1: prompts of --length tokens (plus a 64-token response), each rank its own rows;
- long, fsdp.sp = 2: the same rows, each shared by both ranks (each holds half of every row);
- short, fsdp.sp = 1: the synthetic task's ~5-token prompts, the same model and step.
Each job reports `mem_rise_gib/update_actor` (rank 0): the peak resident memory of the update
stage minus the resident memory at its start (tracking.stage_memory). The long job's rise minus the
short job's is what the long rows' activations and logits took; the plan's `update_actor`
activations + logits columns (`python -m verl_hpc.plan`) are set beside it. The figures go to
benchmarks/results/sp_memory.json.

Why long prompts and not long responses: a random model stops early (EOS), and what the update
holds depends on the tokens of the whole row, not on where the prompt ends.

glibc is told to keep a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_): by default it raises the
threshold to the size of each large block freed, so later blocks of that size come from its heap
and stay resident after they are freed; a stage's "rise" would then be measured from a resident set
that already holds the previous step's freed activations (the first version of this measurement
read 0.91 and 0.55 GiB for sp 1 and 2 that way, with 0.3 GiB of either unexplained).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPE = dict(layers=4, hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1408, max_positions=4096)
RESPONSE = 64
JOB = ["parallel.engine=fsdp", "rollout.engine=hf", f"data.max_response_length={RESPONSE}",
       "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=1",
       "trainer.total_steps=1", "trainer.val_every=0", "tracking.backends=[jsonl]", "tracking.plots=false",
       "slurm.cpus_per_task=1", "slurm.tasks_per_node=2"]
MMAP_THRESHOLD = 128 << 10  # glibc's default starting value, kept fixed


def assets(root: Path, length: int) -> Path:
    from verl_hpc.models.tiny import make_tiny_model

    if not (root / "model" / "config.json").exists():
        make_tiny_model(root / "model", "llama", **SHAPE)
    if not (root / "data" / "train.parquet").exists():
        subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "synthetic", str(root / "data"),
                        "--n-train", "100", "--n-val", "10"], cwd=REPO, check=True, capture_output=True)
    long_rows(root, length)
    return root


def long_rows(root: Path, length: int) -> None:
    """Prompts of `length` tokens of the synthetic task's vocabulary, ending in a question."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok, rng, rows = AutoTokenizer.from_pretrained(root / "model"), random.Random(0), []
    for _ in range(8):
        text = ""
        while len(tok(text)["input_ids"]) < length:
            text += " ".join(f"{rng.randint(0, 9)}+{rng.randint(0, 9)}" for _ in range(200)) + " "
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        prompt = tok.decode(tok(text)["input_ids"][:length - 4]) + f" {a}+{b}="
        rows.append(dict(data_source="synthetic_arith", prompt=prompt, ground_truth=str(a + b)))
    pq.write_table(pa.Table.from_pylist(rows), root / "data" / "long.parquet")


def overrides(root: Path, name: str, length: int) -> list[str]:
    long = name.startswith("long")
    data = root / "data" / ("long.parquet" if long else "train.parquet")
    return [f"model.path={root}/model", f"data.train_files=[{data}]", f"data.val_files=[{root}/data/val.parquet]",
            f"data.max_prompt_length={length + 84 if long else 32}", *JOB, f"fsdp.sp={2 if name == 'long_sp2' else 1}"]


def run(root: Path, name: str, length: int) -> dict:
    out = root / "runs" / name
    shutil.rmtree(out, ignore_errors=True)  # a finished run's folder would resume, not run
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--local", f"trainer.output_dir={out}",
           f"slurm.log_dir={out}/logs/%j", *overrides(root, name, length)]
    print(f"[bench] {name} ...", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"[bench] {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()][-1]
    return {k: row[k] for k in ("mem_rise_gib/update_actor", "mem_peak_gib/update_actor", "timing_s/update_actor",
                                "rollout/prompt_tokens", "rollout/response_tokens")}


def planned(root: Path, name: str, length: int) -> float:
    """The plan's update_actor activations + logits for the job (GiB, one rank)."""
    from verl_hpc.config import load_config
    from verl_hpc.planning import plan_job

    row = plan_job(load_config(str(REPO / "configs/demo_rl.yaml"), overrides(root, name, length))).table["update_actor"]
    return (row.get("activations", 0.0) + row.get("logits", 0.0)) / 2**30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--length", type=int, default=3884, help="tokens per long prompt")
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_sp_memory_"))
    assets(root, args.length)
    m = {name: run(root, name, args.length) for name in ("short", "long_sp1", "long_sp2")}
    base = m["short"]["mem_rise_gib/update_actor"]
    result = {"runs": m, "mmap_threshold": MMAP_THRESHOLD}
    for sp in (1, 2):
        name = f"long_sp{sp}"
        measured = m[name]["mem_rise_gib/update_actor"] - base
        result[name] = dict(measured_gib=round(measured, 3), plan_gib=round(planned(root, name, args.length), 3))
        result[name]["measured_over_plan"] = round(measured / result[name]["plan_gib"], 3)
    result["sp2_over_sp1"] = dict(measured=round(result["long_sp2"]["measured_gib"] / result["long_sp1"]["measured_gib"], 3),
                                  plan=round(result["long_sp2"]["plan_gib"] / result["long_sp1"]["plan_gib"], 3))
    print(json.dumps(result, indent=1))
    (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
    (REPO / "benchmarks" / "results" / "sp_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"[bench] the long rows' update memory per rank: sp 1 {result['long_sp1']['measured_gib']:.3f} GiB "
          f"(plan {result['long_sp1']['plan_gib']:.3f}), sp 2 {result['long_sp2']['measured_gib']:.3f} GiB "
          f"(plan {result['long_sp2']['plan_gib']:.3f}); sp2 / sp1 = {result['sp2_over_sp1']['measured']:.3f} "
          f"(plan {result['sp2_over_sp1']['plan']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
