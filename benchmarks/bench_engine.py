"""Megatron engine forward+backward throughput against transformers, and its TP2 / PP2 cost on CPU.

    python benchmarks/bench_engine.py [--quick] [--threads 2]

1. Peer ratio (one process, TP=1): `MegatronEngine.forward_backward` (the training path: the
   schedule, response log-probs from vocab-parallel logits, a token-mean NLL loss callback) against
   transformers' LlamaForCausalLM (SDPA attention) doing forward + the same loss + backward on the
   same weights and batch. Iterations alternate between the two; medians are compared.
   Goal: ratio >= 0.9.
2. Layout cost (CPU, same total cores): engine fwd+bwd tokens/s at TP2 and PP2 on 2 ranks
   (1 thread each) relative to TP1 on 1 rank (2 threads); 4 micro-batches of 2 sequences at every
   layout (PP needs several micro-batches to overlap its stages). Runs alternate TP1/TP2/PP2.

Model (docs/platform-notes.md, "Reference model and figures"): Llama-style, hidden 512, 8 heads,
4 KV heads, head_dim 64, 6 layers, ffn 1408, vocab 8000 (25.9M parameters), random weights, fp32;
batch 8 x 256 tokens (32-token prompts, 224-token responses). --quick: 2 layers, fewer iterations.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEQS, SEQ_LEN, PROMPT = 8, 256, 32


def make_model(folder: Path, quick: bool) -> Path:
    from verl_hpc.models.tiny import make_tiny_model

    if (folder / "config.json").exists():
        return folder
    return make_tiny_model(folder, "llama", layers=2 if quick else 6, vocab_size=8000, hidden=512,
                           heads=8, kv_heads=4, head_dim=64, ffn=1408, max_positions=512, seed=0)


def make_batch():
    import torch

    from verl_hpc.engines.batch import pack_sequences

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 8000, (SEQS, SEQ_LEN), generator=g)
    return pack_sequences([r[:PROMPT].tolist() for r in ids], [r[PROMPT:].tolist() for r in ids])


def nll_loss(out, mb, counts):
    """token-mean negative log-likelihood of the response tokens (a contribution: global count)."""
    return -(out["log_probs"] * mb["response_mask"]).sum() / counts.tokens, {}


def hf_step(model, batch):
    """transformers: forward, log-softmax at the response positions, the same loss, backward."""
    import torch

    logits = model(batch["input_ids"]).logits[:, PROMPT - 1:-1]
    tokens = batch["input_ids"][:, PROMPT:]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    loss = -logp.mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item()


def build_engine(folder, micro_batch_size):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.megatron import default_options, MegatronEngine

    return MegatronEngine(default_options(model_path=str(folder), optim=OptimConfig(lr=1e-5),
                                          micro_batch_size=micro_batch_size,
                                          use_distributed_optimizer=False))


def timed(fn):
    """(wall seconds, CPU seconds of this process). On a shared machine the CPU time is the
    steadier measure of work; wall time includes waiting for other jobs' threads."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def worker(args) -> None:
    """One rank of a layout run (launched with torchrun-style variables); rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from verl_hpc.parallel import init_model_parallel
    from verl_hpc.runtime import bootstrap

    bootstrap(backend="gloo", num_threads=args.threads)
    init_model_parallel(args.tp, args.pp)
    engine = build_engine(args.model, micro_batch_size=2)
    batch = make_batch()
    for _ in range(args.warmup):
        engine.forward_backward(batch, nll_loss)
    times = []
    for _ in range(args.iters):
        dist.barrier()
        times.append(timed(lambda: engine.forward_backward(batch, nll_loss))[0])
    t = torch.tensor(times)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"median_s": statistics.median(t.tolist())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def peer_ratio(folder, args) -> dict:
    """TP=1 engine vs transformers in this process, alternating iterations."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_hpc.parallel import init_model_parallel
    from verl_hpc.runtime import bootstrap

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    bootstrap(backend="gloo", num_threads=args.threads)
    init_model_parallel(1, 1)
    engine = build_engine(folder, micro_batch_size=SEQS)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    hf.train()
    batch = make_batch()
    loss_engine = float(engine.forward_backward(batch, nll_loss)[0]["loss"])
    loss_hf = hf_step(hf, batch)
    for _ in range(args.warmup):
        engine.forward_backward(batch, nll_loss)
        hf_step(hf, batch)
    te, th = [], []
    for _ in range(args.iters):
        te.append(timed(lambda: engine.forward_backward(batch, nll_loss)))
        th.append(timed(lambda: hf_step(hf, batch)))
    tokens = SEQS * SEQ_LEN
    me, mh = statistics.median(w for w, _ in te), statistics.median(w for w, _ in th)
    ce, ch = statistics.median(c for _, c in te), statistics.median(c for _, c in th)
    return {"engine_tok_s": tokens / me, "hf_tok_s": tokens / mh, "ratio": mh / me,
            "engine_tok_cpu_s": tokens / ce, "hf_tok_cpu_s": tokens / ch, "cpu_ratio": ch / ce,
            "loss_engine": float(loss_engine), "loss_hf": loss_hf,
            "params_m": sum(p.numel() for p in hf.parameters()) / 1e6}


def layout_runs(folder, args) -> dict:
    layouts = {"tp1": (1, 1, 1, args.threads), "tp2": (2, 1, 2, 1), "pp2": (1, 2, 2, 1)}
    medians = {k: [] for k in layouts}
    for rep in range(args.repeats):
        for name, (tp, pp, nproc, threads) in layouts.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={29700 + rep * 10 + len(medians[name]) + tp * 3 + pp}",
                   __file__, "--worker", "--model", str(folder), "--tp", str(tp), "--pp", str(pp),
                   "--threads", str(threads), "--iters", str(args.iters), "--warmup", str(args.warmup)]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), VERL_HPC_LOGLEVEL="WARNING",
                       PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            medians[name].append(json.loads(line[0][7:])["median_s"])
    tokens = SEQS * SEQ_LEN
    tok_s = {k: tokens / statistics.median(v) for k, v in medians.items()}
    return {"tok_s": tok_s, "relative_to_tp1": {k: v / tok_s["tp1"] for k, v in tok_s.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per job (split over ranks)")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=0, help="alternated layout runs")
    ap.add_argument("--model", default="")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--skip-layouts", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("VERL_HPC_LOGLEVEL", "WARNING")
    args.iters = args.iters or (3 if args.quick else 7)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(args.model) if args.model else Path(tmp) / "model", args.quick)
        peer = peer_ratio(folder, args)
        print(f"model {peer['params_m']:.1f}M params, batch {SEQS} x {SEQ_LEN} tokens, "
              f"{args.threads} threads, {args.iters} iterations (median), {args.warmup} warm-up")
        print(f"loss: engine {peer['loss_engine']:.6f}  transformers {peer['loss_hf']:.6f}")
        print(f"fwd+bwd TP1 wall: engine {peer['engine_tok_s']:.0f} tok/s, transformers "
              f"{peer['hf_tok_s']:.0f} tok/s, ratio {peer['ratio']:.3f} (goal >= 0.9)")
        print(f"fwd+bwd TP1 CPU time: engine {peer['engine_tok_cpu_s']:.0f} tok/cpu-s, transformers "
              f"{peer['hf_tok_cpu_s']:.0f} tok/cpu-s, ratio {peer['cpu_ratio']:.3f}")
        if not args.skip_layouts:
            lay = layout_runs(folder, args)
            for name in ("tp1", "tp2", "pp2"):
                print(f"fwd+bwd {name.upper()}: {lay['tok_s'][name]:.0f} tok/s, "
                      f"{lay['relative_to_tp1'][name]:.3f} x TP1 ({args.repeats} alternated runs)")


if __name__ == "__main__":
    main()
