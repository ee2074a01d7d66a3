"""Jobs for the tests: the shared tiny assets, and one-rank jobs run inside the test process.

A job started as `python -m verl_hpc.submit ... --local` costs two fresh interpreters (the
submitter and the rank), each importing torch, Megatron and transformers before the first step:
on a 2-core machine that start-up is most of a 3-step job. `run_here` runs the same entry a rank
runs (`verl_hpc.job.main`: load, validate, bootstrap, the program, the one-line error report) in
this process instead, so only the first job of a session pays for the imports. What the job
changes in the process (the process group, Megatron's parallel state and its CPU replacements,
signal handlers, thread count, logging handlers, MASTER_* variables) is put back afterwards, so a
later test sees the process as it was.

Each entry point keeps real command-line runs (the SFT warm start, GRPO learning on 2 ranks, DPO
across layouts, the local launcher tests, the Slurm tests); `run_here` is for the many short
one-rank jobs that test the trainer.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Tuple

REPO = Path(__file__).resolve().parents[1]
SUMMARIES = ("rl_summary.json", "sft_summary.json", "dpo_summary.json")


# ------------------------------------------------------------------------------ the shared assets
def make_assets(root: Path, sft_noise: float = 0.62) -> Path:
    """A 2-layer tiny model and the synthetic task (train, val, SFT and preference files) under
    `root`; built once per folder (a session fixture shares one folder, tests/conftest.py)."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "verl_hpc.models.tiny", str(root / "model"), "--layers", "2"],
                       cwd=REPO, check=True, capture_output=True)
    if not (root / "data" / "kto_train.parquet").exists():  # the last file written
        subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "synthetic", str(root / "data"),
                        "--n-train", "2000", "--n-val", "100", "--sft-noise", str(sft_noise), "--preference"],
                       cwd=REPO, check=True, capture_output=True)
    return root


def data_overrides(root: Path):
    return [f"data.train_files=[{root}/data/train.parquet]", f"data.val_files=[{root}/data/val.parquet]",
            f"data.sft_files=[{root}/data/sft.parquet]"]


def warm_start(root: Path) -> Path:
    """The SFT warm start on the noisy labels (about 40% greedy accuracy) under `root/sft/hf`:
    600 steps, built once and shared by the RL and preference learning tests. It is also the SFT
    program's one run through the user's command line (`python -m verl_hpc.submit --local`).
    One thread: with two, some CPU backward kernel varies in its last bits from run to run, and 600
    steps grow that into warm starts of 31% or 50% greedy accuracy (docs/platform-notes.md,
    "Reproducible runs"); the learning tests' figures would then depend on the session."""
    out = root / "sft"
    if not (out / "hf" / "model.safetensors").exists():
        proc, _ = run_job("configs/demo_sft.yaml", out, f"model.path={root}/model", *data_overrides(root),
                          "trainer.total_steps=600", "trainer.sft_epochs=30", f"trainer.hf_output_dir={out}/hf",
                          "tracking.plots=false", "slurm.cpus_per_task=1", timeout=1200)  # about 2 min alone; much more on a loaded machine
        assert proc.returncode == 0, logs(proc, out)
    return out / "hf"


# ------------------------------------------------------------------------------ reading a job's output
def summary_of(out: Path):
    for name in SUMMARIES:
        if (out / name).exists():
            return json.loads((out / name).read_text())
    return None


def metrics(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def logs(proc, out: Path) -> str:
    text = proc.stdout[-4000:] + proc.stderr[-4000:]
    for f in sorted(out.glob("logs/**/*.log")):
        text += f"\n--- {f}\n" + f.read_text(errors="replace")[-3000:]
    return text


# ------------------------------------------------------------------------------ running a job
def run_job(config: str, out: Path, *overrides, ranks: int = 1, timeout: int = 400, env=None):
    """One job through the user's command line (`python -m verl_hpc.submit --local`); returns
    (CompletedProcess, rank 0's summary dict or None)."""
    cmd = [sys.executable, "-m", "verl_hpc.submit", config, "--local", f"slurm.tasks_per_node={ranks}",
           f"trainer.output_dir={out}", f"slurm.log_dir={out}/logs/%j", *overrides]
    # its own session, so that a timeout kills the ranks too (killing only the submitter would leave
    # them running, loading the machine under every later test)
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as p:
        try:
            out_text, err_text = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
    proc = subprocess.CompletedProcess(cmd, p.returncode, out_text, err_text)
    return proc, summary_of(out)


def run_here(config: str, out: Path, *overrides):
    """One rank of a job in this process (what `python -m verl_hpc.job CONFIG ...` runs); returns
    (CompletedProcess with the exit code and everything printed, the summary dict or None).

    Known errors end as in a rank: one `error: ...` line and the class's exit code; an unknown
    exception is printed with its traceback and exit code 1, as an uncaught one would be."""
    from verl_hpc import job

    argv = [config, f"trainer.output_dir={out}", "slurm.tasks_per_node=1", *overrides]
    stdout, stderr = io.StringIO(), io.StringIO()
    with _process_restored(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = job.main(argv)
        except SystemExit as e:  # a requeue or a program that exits on purpose; None means 0
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - what an uncaught exception does to a rank
            traceback.print_exc()
            code = 1
    proc = subprocess.CompletedProcess(["verl_hpc.job", *argv], code, stdout.getvalue(), stderr.getvalue())
    return proc, summary_of(out)


@contextlib.contextmanager
def _process_restored():
    """Put back what a job changes in its process (see the module docstring)."""
    import torch

    env = dict(os.environ)
    threads = torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}
    root = logging.getLogger()
    log_state = (list(root.handlers), root.level)
    # the job's log lines go to the redirected stderr: logging.basicConfig(force=True) in the job
    # builds its handler on sys.stderr as it is when the job starts
    try:
        yield
    finally:
        _tear_down_parallel()
        for s, h in handlers.items():
            signal.signal(s, h)
        torch.set_num_threads(threads)
        for h in root.handlers:
            if h not in log_state[0]:
                h.close()
        root.handlers[:], root.level = log_state
        os.environ.clear()
        os.environ.update(env)


def _tear_down_parallel():
    """A job that failed half-way can leave Megatron's groups and the process group behind."""
    import torch.distributed as dist

    from verl_hpc.parallel import cpu_compat, destroy_model_parallel

    with contextlib.suppress(Exception):
        destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    cpu_compat.revert()


# ------------------------------------------------------------------------------ the usual tiny runs
# GRPO on 1 rank with the HF rollout (seeded per step: a resumed run samples what the straight
# run sampled); a batch of 4 prompts x 4 samples keeps a step about a second on 2 cores.
TINY_GRPO = ["rollout.engine=hf", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
             "actor.micro_batch_size=8", "trainer.val_every=0", "tracking.backends=[jsonl]",
             "tracking.plots=false"]
# the weights must move every step (constant LR, entropy bonus) for "bitwise equal" to mean much;
# the tiny model never answers right, so rewards and GRPO advantages are all zero without it
MOVING = ["actor.entropy_coeff=0.01", "actor.optim.lr=1e-3", "actor.optim.lr_decay_style=constant"]
# metrics that measure the machine, not the run
VOLATILE = ("timing_s/", "perf/", "throughput/", "time", "sync/seconds", "sync/gb_per_s",
            "sync/export_seconds", "sync/load_seconds", "rollout/seconds", "rollout/tokens_per_s",
            "episode/tool_latency", "mem_peak_gib/", "mem_rise_gib/", "judge/latency_s")


def grpo(root: Path, out: Path, *extra, ranks: int = 1, timeout: int = 400):
    """A tiny GRPO job: one rank in this process, more through the command line."""
    args = [f"model.path={root}/model", *data_overrides(root), *TINY_GRPO, *extra]
    if ranks == 1:
        return run_here("configs/demo_rl.yaml", out, *args)
    return run_job("configs/demo_rl.yaml", out, *args, ranks=ranks, timeout=timeout)


def small(root: Path, *extra):
    """3 RL steps of 4 prompts with tiny micro-batches (every recipe's test, the mismatch tests).
    No PNG curves: drawing them is about a third of such a job's CPU, and the tests that look at
    the curves ask for them (tests/unit/tracking, test_trn_moe.py, test_tasks_guard.py)."""
    return [f"model.path={root}/model", *data_overrides(root), "rollout.engine=hf", "tracking.plots=false",
            "trainer.total_steps=3", "trainer.val_every=0", "data.train_batch_size=4",
            "data.max_response_length=4", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
            "actor.micro_batch_size=2", "critic.micro_batch_size=2", "actor.optim.lr=1e-4",
            "slurm.cpus_per_task=2", *extra]


def straight_and_resumed(run, tmp: Path, *extra) -> Tuple[Path, Path, object]:
    """The same job run straight to its last step (`straight`), and stopped after step 1 with a
    checkpoint then resumed to the end (`split`); every launch must succeed and the resume start at
    step 1. run(out, *overrides) -> (proc, summary), the caller's job with its own overrides.
    Returns the two output folders and the resumed launch's process."""
    straight, split = tmp / "straight", tmp / "split"
    proc, _ = run(straight, *extra)
    assert proc.returncode == 0, logs(proc, straight)
    proc, _ = run(split, *extra, "trainer.total_steps=1", "checkpoint.save_every=1")
    assert proc.returncode == 0, logs(proc, split)
    proc, s = run(split, *extra)
    assert proc.returncode == 0 and s["resumed_from"] == 1, logs(proc, split)
    return straight, split, proc


def stable_metrics(out: Path):
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in metrics(out)]


def read_all(ckpt) -> dict:
    """{name: full tensor} of every tensor of a checkpoint (root or directory)."""
    from verl_hpc.checkpoint import open_checkpoint

    with open_checkpoint(ckpt) as r:
        return {name: r.load_tensor(name) for name in r.tensors()}
