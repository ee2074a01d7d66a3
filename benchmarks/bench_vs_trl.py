"""GRPO step time and time to an accuracy gain: verl_hpc against Hugging Face TRL, same run.

    pip install -e '.[cpu,bench]'                      # TRL is only needed here
    python benchmarks/bench_vs_trl.py                  # tiny model, 1 and 2 ranks, 16 steps, +40 points
    python benchmarks/bench_vs_trl.py --quick          # 1 rank, 10 steps, no accuracy target
    python benchmarks/bench_vs_trl.py --ranks 1 --steps 30 --gain 45

The task, model and warm start are the project's own and the same for both: the synthetic
"a+b=" task (verl_hpc.data.prepare synthetic), the tiny Llama of verl_hpc.models.tiny (2 layers,
hidden 128, vocab 500; 0.4M parameters), warm-started by the project's SFT on noisy labels (as in
`make demo`; built once under --out and reused). GRPO at matched settings on both sides:
16 prompts x 8 samples a step, at most 8 new tokens, temperature 1, one optimizer step per batch
(one mini-batch, one epoch), token-mean loss, clip 0.2, no KL (beta 0), AdamW lr 1e-3 constant,
grad-norm clip 1.0, fp32, the same reward rule (verl_hpc.rewards.basic.synthetic_arith_score).
verl_hpc runs as a job (`python -m verl_hpc.submit configs/demo_rl.yaml --local`, `rollout.engine:
auto`, which picks HF generate for this model size on CPU; `--verl-set rollout.engine=vllm` to
compare); TRL's GRPOTrainer runs in its own process with HF `generate` (its default CPU path; TRL's
vLLM modes need a GPU). Both get --threads torch threads per process (1: see the option's comment;
verl_hpc through slurm.cpus_per_task).

Printed per rank count: seconds per step by stage (medians over steps 2..N, step 1 carries
warm-up) for both, the step-time ratio verl_hpc / TRL, and the training time (sum of step times,
validation excluded on both sides) until greedy validation accuracy on the same 100 held-out
prompts first reaches the warm start's + --gain points, and that ratio. Stage names: verl_hpc's
timing_s/* (generate, reward, old_logprob when it runs, update_actor, sync, ...); TRL's generate
(HF generate), score (rewards, advantages, the rest of _generate_and_score_completions), forward
(compute_loss), backward, optimizer (the rest of the step: clip, AdamW, bookkeeping).

The machine is shared: compare ratios from one invocation, not absolute times across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS, N, NEW_TOKENS, LR = 16, 8, 8, 1e-3


def sh(cmd, what: str, log: Path = None) -> None:
    print(f"[bench] {what}: {' '.join(map(str, cmd))}", flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as out:
        rc = subprocess.call([str(c) for c in cmd], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        sys.exit(f"bench: {what} failed (exit {rc}){'; log: ' + str(log) if log else ''}")


def assets(out: Path, sft_steps: int) -> Path:
    """Tiny model, synthetic data and the SFT warm start (each built once, then reused)."""
    py = sys.executable
    if not (out / "model" / "config.json").exists():
        sh([py, "-m", "verl_hpc.models.tiny", out / "model", "--family", "llama", "--layers", "2", "--seed", "0"],
           "tiny model")
    if not (out / "data" / "val.parquet").exists():
        sh([py, "-m", "verl_hpc.data.prepare", "synthetic", out / "data", "--n-train", "2000", "--n-val", "100",
            "--seed", "0", "--sft-noise", "0.62"], "synthetic data")
    ws = out / "sft" / "hf"
    if not (ws / "config.json").exists():
        sh([py, "-m", "verl_hpc.submit", "configs/demo_sft.yaml", "--local", f"model.path={out}/model",
            f"data.train_files=[{out}/data/train.parquet]", f"data.sft_files=[{out}/data/sft.parquet]",
            f"trainer.output_dir={out}/sft", f"trainer.hf_output_dir={ws}", f"trainer.total_steps={sft_steps}",
            f"slurm.log_dir={out}/sft/logs"], "SFT warm start", out / "sft.log")
    return ws


# ------------------------------------------------------------------------------------ verl_hpc
def run_verl(out: Path, ws: Path, data: Path, ranks: int, steps: int, val_every: int, *extra: str,
             tag: str = "", threads: int = 1) -> dict:
    run = out / f"verl_{ranks}rank{tag}"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run (an earlier one's checkpoints would be refused)
    sh([sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--local", f"model.path={ws}",
        f"data.train_files=[{data}/train.parquet]", f"data.val_files=[{data}/val.parquet]",
        f"data.train_batch_size={PROMPTS}", f"actor.ppo_mini_batch_size={PROMPTS}",
        f"actor.micro_batch_size={PROMPTS * N // ranks}", f"rollout.n={N}", f"data.max_response_length={NEW_TOKENS}",
        f"actor.optim.lr={LR}", "actor.optim.lr_decay_style=constant", "actor.optim.min_lr=0",
        f"trainer.total_steps={steps}", f"trainer.val_every={val_every}", "tracking.backends=[jsonl]",
        f"slurm.tasks_per_node={ranks}", f"trainer.output_dir={run}", f"slurm.log_dir={run}/logs",
        "trainer.resume=never", "checkpoint.keep_last=1", "rollout.engine=auto", f"slurm.cpus_per_task={threads}",
        *extra], f"verl_hpc GRPO, {ranks} rank(s){tag}",
       out / f"verl_{ranks}rank{tag}.log")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps_rows = [r for r in rows if "timing_s/step" in r]
    stages = {k[len("timing_s/"):]: _median([r[k] for r in steps_rows[1:] if k in r])
              for k in sorted({k for r in steps_rows for k in r if k.startswith("timing_s/")})
              if k != "timing_s/validation"}
    step_time = {int(r["step"]): r["timing_s/step"] for r in steps_rows}
    val = {int(r["step"]): r["val/acc/all"] for r in rows if "val/acc/all" in r}
    return dict(stages=stages, step_times=step_time, val=val)


# ------------------------------------------------------------------------------------ TRL
def trl_worker(args) -> None:
    """One TRL GRPOTrainer run (its own process); writes stage timings and validation to JSON."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_hpc.rewards.basic import synthetic_arith_score

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data, ws, steps = Path(args.data), Path(args.ws), args.steps
    tok = AutoTokenizer.from_pretrained(ws)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(ws, dtype=torch.float32)
    train = pq.read_table(data / "train.parquet").to_pylist()
    val = pq.read_table(data / "val.parquet").to_pylist()
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "ground_truth": r["ground_truth"]}
                            for r in train])

    def reward(prompts, completions, ground_truth, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [synthetic_arith_score(t, g) for t, g in zip(texts, ground_truth)]

    val_text = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                        add_generation_prompt=True) for r in val]

    @torch.no_grad()
    def accuracy(m) -> float:
        was = m.training
        m.eval()
        enc = tok(val_text, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = m.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        m.train(was)
        return sum(synthetic_arith_score(t, r["ground_truth"]) for t, r in zip(texts, val)) / len(val)

    cfg = GRPOConfig(
        output_dir=str(Path(args.out) / "trl_run"), max_steps=steps, per_device_train_batch_size=PROMPTS * N,
        gradient_accumulation_steps=1, num_generations=N, max_completion_length=NEW_TOKENS, temperature=1.0,
        top_p=1.0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, logging_steps=10 ** 6, save_strategy="no", report_to="none",
        seed=args.seed, use_vllm=False, log_completions=False, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok)

    times = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed("gen_score", trainer._generate_and_score_completions)
    trainer.compute_loss = timed("forward", trainer.compute_loss)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    record = dict(stages=[], step_times={}, val={0: accuracy(model)})

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            times.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            step_s = time.perf_counter() - self.t0
            s = dict(times)
            gen, gs = s.get("generate", 0.0), s.pop("gen_score", 0.0)
            s["score"] = gs - gen
            s["optimizer"] = step_s - gs - s.get("forward", 0.0) - s.get("backward", 0.0)
            s["step"] = step_s
            record["stages"].append(s)
            record["step_times"][state.global_step] = step_s
            if args.val_every and (state.global_step % args.val_every == 0 or state.global_step == steps):
                record["val"][state.global_step] = accuracy(trainer.model)  # outside the step's clock

    trainer.add_callback(Clock())
    trainer.train()
    Path(args.result).write_text(json.dumps(record))


def run_trl(out: Path, ws: Path, data: Path, steps: int, val_every: int, threads: int) -> dict:
    result = out / "trl.json"
    sh([sys.executable, __file__, "--trl-worker", "--out", out, "--ws", ws, "--data", data, "--steps", steps,
        "--val-every", val_every, "--threads", threads, "--result", result], "TRL GRPOTrainer, 1 process",
       out / "trl.log")
    rec = json.loads(result.read_text())
    stages = {k: _median([s[k] for s in rec["stages"][1:] if k in s]) for k in rec["stages"][0]}
    return dict(stages=stages, step_times={int(k): v for k, v in rec["step_times"].items()},
                val={int(k): v for k, v in rec["val"].items()})


# ------------------------------------------------------------------------------------ report
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def time_to_gain(res: dict, gain: float):
    """(seconds of training steps, step) until validation accuracy >= start + gain; None if never."""
    start = res["val"].get(0)
    if start is None:
        return None, None, None
    for step in sorted(s for s in res["val"] if s > 0):
        if 100 * (res["val"][step] - start) >= gain:
            return sum(t for s, t in res["step_times"].items() if s <= step), step, start
    return None, None, start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/bench_vs_trl")
    ap.add_argument("--quick", action="store_true", help="1 rank, 10 steps, no accuracy target")
    ap.add_argument("--ranks", default=None, help="comma list of verl_hpc rank counts (default 1,2)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 16)")
    ap.add_argument("--val-every", type=int, default=1)
    ap.add_argument("--gain", type=float, default=40.0, help="validation accuracy points for time-to-gain")
    ap.add_argument("--sft-steps", type=int, default=1000)
    # 1: on a loaded machine TRL's process with 2 torch threads ran ~8x slower per step than with
    # 1 (OpenMP threads waiting on each other when the cores are shared); TRL gets its faster setting
    ap.add_argument("--threads", type=int, default=1, help="torch threads of TRL's process")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--verl-set", action="append", default=[],
                    help="an extra override for every verl_hpc run, e.g. rollout.engine=hf (repeatable)")
    ap.add_argument("--with-old-forward", action="store_true",
                    help="also run verl_hpc at 1 rank with actor.old_log_probs=forward (the separate pass)")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ws", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trl_worker:
        trl_worker(a)
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("bench_vs_trl needs TRL: pip install -e '.[bench]'")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ranks = [int(r) for r in (a.ranks or ("1" if a.quick else "1,2")).split(",")]
    steps = a.steps or (10 if a.quick else 16)
    val_every = 0 if a.quick else a.val_every
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"[bench] {os.cpu_count()} CPUs, load average {load:.1f} at start", flush=True)
    ws = assets(out, a.sft_steps)
    data = out / "data"
    results = {"trl": run_trl(out, ws, data, steps, val_every, a.threads)}
    for r in ranks:
        results[f"verl_{r}"] = run_verl(out, ws, data, r, steps, val_every, *a.verl_set, threads=a.threads)
    if a.with_old_forward:
        results["verl_1_oldfwd"] = run_verl(out, ws, data, 1, steps, 0, *a.verl_set, "actor.old_log_probs=forward",
                                            tag="_oldfwd", threads=a.threads)
    t = results["trl"]
    print(f"\nGRPO, tiny Llama (0.4M), {PROMPTS} prompts x {N} samples, <= {NEW_TOKENS} new tokens, {steps} steps; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"  TRL       s/step {t['stages']['step']:.3f}  by stage: "
          + ", ".join(f"{k} {v:.3f}" for k, v in t["stages"].items() if k != "step"))
    for r in ranks:
        v = results[f"verl_{r}"]
        print(f"  verl_hpc {r} rank(s) s/step {v['stages']['step']:.3f}  by stage: "
              + ", ".join(f"{k} {x:.3f}" for k, x in v["stages"].items() if k != "step"))
        print(f"    ratio verl_hpc/TRL s/step at {r} rank(s): {v['stages']['step'] / t['stages']['step']:.2f}")
    if a.with_old_forward and 1 in ranks:
        f, c = results["verl_1_oldfwd"]["stages"], results["verl_1"]["stages"]
        print(f"  verl_hpc 1 rank, separate old-log-prob forward: s/step {f['step']:.3f} (old_logprob "
              f"{f.get('old_logprob', float('nan')):.3f}); on-policy shortcut / separate: {c['step'] / f['step']:.2f}")
    if val_every:
        ts, tstep, t0 = time_to_gain(t, a.gain)
        print(f"  time to +{a.gain:g} validation points (training time, validation excluded):")
        print(f"    TRL: " + (f"{ts:.1f} s (step {tstep}; start {100 * t0:.0f}%)" if ts else
                              f"not reached in {steps} steps (start {100 * (t0 or 0):.0f}%, "
                              f"best {100 * max(t['val'].values()):.0f}%)"))
        for r in ranks:
            v = results[f"verl_{r}"]
            vs, vstep, v0 = time_to_gain(v, a.gain)
            line = (f"{vs:.1f} s (step {vstep}; start {100 * v0:.0f}%)" if vs else
                    f"not reached in {steps} steps (start {100 * (v0 or 0):.0f}%, best {100 * max(v['val'].values()):.0f}%)")
            ratio = f"; ratio verl_hpc/TRL {vs / ts:.2f}" if vs and ts else ""
            print(f"    verl_hpc {r} rank(s): {line}{ratio}")
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"[bench] details: {out}/summary.json, logs in {out}/*.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
