"""How much of the policy changes per RL step in a bf16 rollout: the delta weight sync's workload,
measured on a real GRPO run.

    python benchmarks/bench_delta_fraction.py                      # Llama 102M, lr 1e-6 and 1e-5, 6 steps each
    python benchmarks/bench_delta_fraction.py --lrs 1e-6 --steps 4

A real job (configs/demo_rl.yaml, the synthetic "a+b=" task, GRPO, 8 prompts x 8 samples, HF
rollout on CPU) runs in this process on one rank with one extra hook before the logging hook:
after every step it exports the actor's weights (the HF tensors the sync sends), casts them to
bf16 and compares their bits with the previous step's. Per step it reports the fraction of
elements whose bf16 value changed and the bytes the delta sync would send for them
(verl_hpc.resharding.delta: per tensor the smallest of dense, index and bitmap) against the dense
bf16 bytes; the float32 fraction beside it shows why the delta option is for bf16 rollouts (an
Adam step moves nearly every float32 value). The model is bench_vs_trl's "100m" Llama (12 layers,
hidden 768, 4 KV heads, ffn 2560, vocab 8000: 102M parameters), random init (std 0.02), made by
verl_hpc.models.tiny; verl's default actor LR is 1e-6.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAPE = dict(hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=2560, max_positions=512)


class ChangedFraction:
    """A trainer hook (verl_hpc/trainer/hooks/base.py): bf16 / fp32 changed fractions of the actor's
    exported weights since the previous step, added to the step's metrics as bench/*."""

    stage = "bench_changed_fraction"

    def __init__(self, actor):
        self.actor = actor
        self.prev = self._weights()
        self.rows = []

    def _weights(self):
        import torch

        with torch.no_grad():
            return {n: t.detach().to(torch.float32).clone() for n, t in self.actor.engine.export_hf_weights()}

    def __call__(self, step, metrics, run):
        import torch

        from verl_hpc.resharding import delta
        from verl_hpc.trainer.hooks.base import CONTINUE

        cur = self._weights()
        total = changed16 = changed32 = delta_bytes = 0
        for name, t in cur.items():
            old = self.prev[name]
            new16, old16 = t.to(torch.bfloat16), old.to(torch.bfloat16)
            _, k, payload = delta.encode(new16, old16)
            changed16 += k
            changed32 += int(torch.count_nonzero(delta.bits(t) != delta.bits(old)))
            delta_bytes += payload.numel()
            total += t.numel()
        row = {"step": step, "bf16_changed_fraction": changed16 / total,
               "fp32_changed_fraction": changed32 / total, "delta_bytes": delta_bytes, "dense_bf16_bytes": 2 * total}
        self.rows.append(row)
        metrics.update({f"bench/{k}": float(v) for k, v in row.items() if k != "step"})
        print(f"[bench] step {step}: bf16 changed {row['bf16_changed_fraction'] * 100:.2f}% of {total / 1e6:.1f} M "
              f"elements -> delta {delta_bytes / 1e6:.1f} MB of {2 * total / 1e6:.1f} MB dense "
              f"({delta_bytes / (2 * total):.3f}x); fp32 changed {row['fp32_changed_fraction'] * 100:.1f}%", flush=True)
        self.prev = cur
        return CONTINUE


def run_job(work: Path, model: Path, data: Path, lr: float, steps: int) -> list:
    from verl_hpc.config import load_config
    from verl_hpc.job import run
    from verl_hpc.trainer.programs import rl

    cfg = load_config(str(REPO / "configs/demo_rl.yaml"), [
        f"model.path={model}", f"data.train_files=[{data}/train.parquet]", f"data.val_files=[{data}/val.parquet]",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=64", "rollout.n=8",
        "data.max_response_length=24", f"actor.optim.lr={lr}", "actor.optim.lr_decay_style=constant",
        "actor.optim.min_lr=0", f"trainer.total_steps={steps}", "trainer.val_every=0",
        "tracking.backends=[jsonl]", "tracking.plots=false", f"trainer.output_dir={work}",
        "trainer.resume=never", "checkpoint.save_every=0", "rollout.engine=hf", "slurm.cpus_per_task=2"])
    shutil.rmtree(work, ignore_errors=True)  # a fresh run (an earlier one's checkpoints would be refused)
    hooks, made = rl.RLTrainer.hooks, []

    def with_measurement(trainer, stop_rule):
        made.append(ChangedFraction(trainer.roles.actor))
        return [made[-1]] + hooks(trainer, stop_rule)

    rl.RLTrainer.hooks = with_measurement
    try:
        run(cfg)
    finally:
        rl.RLTrainer.hooks = hooks
    return made[-1].rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--work", default="outputs/bench_delta_fraction")
    ap.add_argument("--out", default="benchmarks/results/delta_fraction.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one LR, write its rows here
    a = ap.parse_args(argv)
    if not a.one:
        print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.pop("SLURM_JOB_ID", None)
    work = Path(a.work).absolute()
    model, data = work / "model_100m", work / "data"
    if not (model / "config.json").exists():
        from verl_hpc.models.tiny import make_tiny_model

        make_tiny_model(model, "llama", layers=12, vocab_size=8000, seed=0, **SHAPE)
    if not (data / "train.parquet").exists():
        subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "synthetic", str(data), "--n-train", "2000",
                        "--n-val", "100", "--seed", "0"], cwd=REPO, check=True, capture_output=True)
    if a.one:  # one job per process: Megatron's parallel state does not survive a second job
        Path(a.one).write_text(json.dumps(run_job(work / f"run_lr{a.lrs[0]:g}", model, data, a.lrs[0], a.steps)))
        return 0
    results = {}
    for lr in a.lrs:
        t0 = time.time()
        rows_file = work / f"rows_lr{lr:g}.json"
        subprocess.run([sys.executable, __file__, "--lrs", str(lr), "--steps", str(a.steps), "--work", str(work),
                        "--one", str(rows_file)], cwd=REPO, check=True)
        rows = json.loads(rows_file.read_text())
        fr = [r["bf16_changed_fraction"] for r in rows]
        ratio = [r["delta_bytes"] / r["dense_bf16_bytes"] for r in rows]
        results[f"{lr:g}"] = dict(rows=rows, seconds=round(time.time() - t0, 1))
        print(f"[bench] lr {lr:g}: bf16 changed per step median {statistics.median(fr) * 100:.2f}% "
              f"(min {min(fr) * 100:.2f}%, max {max(fr) * 100:.2f}%); delta / dense bytes median "
              f"{statistics.median(ratio):.3f}; fp32 changed {statistics.median(r['fp32_changed_fraction'] for r in rows) * 100:.1f}%",
              flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"[bench] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
