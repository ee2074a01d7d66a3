"""trainer.job=dpo through the real engine.

- One DPO step at TP2, at PP2 (both in make test-long), and with dynamic batching over two
  data-parallel ranks gives the TP1 weights (within 1e-5), and the step's first loss is log 2
  (policy = reference). With dynamic batching the pairs' chosen and rejected rows land in
  different micro-batches and on different ranks (checked on the engine's own plan), so the loss is
  right because of the two-pass step, not because pairs happen to stay together.
- Checkpoints and resume: a run stopped by SIGTERM mid-run (saved at the step boundary) and run
  again resumes from `latest` and ends bitwise equal (weights, Adam moments, metrics) to the run
  that was never stopped.

lr 1e-4: Adam's first step moves each weight by about lr * g / (|g| + eps), so on weights whose
gradient is ~0 a float-rounding difference of the gradient between layouts becomes a visible
fraction of lr (measured: 4.6e-5 at lr 1e-3 for TP2), whatever the loss."""
import json
import math
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from jobs import REPO, logs, read_all, run_here, run_job

pytestmark = pytest.mark.no_vllm("DPO: preference pairs, no rollout")

BUDGET = 36  # actor.max_tokens_per_microbatch: the smallest the config allows (max prompt + response)


@pytest.fixture
def assets(tiny_assets):
    return tiny_assets


def dpo_args(assets, *extra):
    return ["configs/demo_dpo.yaml", f"model.path={assets}/model",
            f"data.preference_files=[{assets}/data/preference_train.parquet]",
            "data.preference_val_files=[]", f"data.train_files=[{assets}/data/train.parquet]",
            f"data.val_files=[{assets}/data/val.parquet]", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2", "trainer.total_steps=1",
            "trainer.val_every=0", "slurm.cpus_per_task=1", "actor.optim.lr=1e-4",
            "tracking.backends=[jsonl]", "tracking.plots=false", *extra]


def dpo(assets, out, ranks, *extra):
    config, *overrides = dpo_args(assets, *extra)
    if ranks == 1:  # the reference runs: in this process (tests/jobs.py); the layouts: command line
        proc, summary = run_here(config, out, *overrides)
    else:
        proc, summary = run_job(config, out, *overrides, ranks=ranks, timeout=600)
    assert proc.returncode == 0, logs(proc, out)
    return load_file(str(out / "hf" / "model.safetensors")), summary


def first_batch_plan(assets, dp):
    """The engine's micro-batch plan for the first step's 4 pairs under dynamic batching."""
    from transformers import AutoTokenizer

    from verl_hpc.config import load_config
    from verl_hpc.data.preference import load_preference_examples
    from verl_hpc.data.sampler import EpochSampler
    from verl_hpc.engines.partition import plan_microbatches
    from verl_hpc.trainer.programs.preference import build_batch

    cfg = load_config(REPO / "configs/demo_dpo.yaml")
    tok = AutoTokenizer.from_pretrained(str(assets / "model"))
    d = cfg.data
    ex = load_preference_examples([str(assets / "data/preference_train.parquet")], tok, "dpo",
                                  prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                                  completion_key=d.completion_key, label_key=d.label_key,
                                  wrap_plain_text=cfg.data.wrap_plain_text,
                                  max_length=cfg.data.max_prompt_length + cfg.data.max_response_length)
    take = EpochSampler(len(ex), seed=cfg.data.seed, fingerprint="").next_indices(4)
    batch = build_batch([ex[i] for i in take], "dpo", 0)
    lengths = (batch["prompt_lengths"] + batch["response_lengths"]).tolist()
    return plan_microbatches(lengths, dp, max_tokens=BUDGET)


@pytest.fixture(scope="module")
def tp1_step(tiny_assets, tmp_path_factory):
    """The reference: one DPO step at TP1, in this process. Its first loss is log 2 (policy =
    reference) and it moved the weights."""
    base, summary = dpo(tiny_assets, tmp_path_factory.mktemp("dpo_tp1"), 1)
    assert summary["first_loss"] == pytest.approx(math.log(2), abs=1e-6)
    start = load_file(str(next((tiny_assets / "model").glob("*.safetensors"))))
    assert any(not torch.equal(base[k], start[k]) for k in base)  # the step changed the weights
    return base


# TP2's and PP2's launches are in make test-long (two more 2-rank launches, 45 CPU-s): make test keeps
# dynamic batching's, the layout only DPO's two-pass step makes right. make test still runs the trainer
# at TP2 x PP2 (tests/dist/checkpoint/test_ckpt_trainer_layouts.py, a GRPO job) and the engine's
# forward and backward at TP2 and at PP2 against one rank (tests/dist/engines/test_eng_parity.py).
@pytest.mark.parametrize("layout,extra", [
    pytest.param("tp2", ["parallel.tp=2"], marks=pytest.mark.long),
    pytest.param("pp2", ["parallel.pp=2"], marks=pytest.mark.long),
    ("dp2_dynamic", [f"actor.max_tokens_per_microbatch={BUDGET}"]),
], ids=["tp2", "pp2", "dp2_dynamic"])
def test_trn_dpo_step_at_a_layout_equals_tp1(assets, tmp_path, tp1_step, layout, extra):
    if layout == "dp2_dynamic":  # dynamic batching splits every pair (rows i and i + 4) across micro-batches or ranks
        plan = first_batch_plan(assets, dp=2)
        together = [rows for rank in plan for rows in rank if any(i + 4 in rows for i in rows)]
        assert not together, plan
    other, _ = dpo(assets, tmp_path / layout, 2, *extra)
    assert other.keys() == tp1_step.keys()
    worst = max(float((other[k] - tp1_step[k]).abs().max()) for k in tp1_step)
    assert worst <= 1e-5, (layout, worst)


def stable_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k.startswith(("preference/", "rewards/", "logps/", "step"))}
            for r in rows]


@pytest.mark.long  # three launches (make test-long); make test covers a SIGTERM stop and a bitwise
# resume in tests/jobs/test_resume.py and tests/dist/test_local_signals.py, and the DPO step here
def test_trn_dpo_sigterm_then_resume_is_bitwise_the_straight_run(assets, tmp_path, wait_for_text):
    steps = 10
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = [f"trainer.total_steps={steps}", "checkpoint.save_every=3"]
    dpo(assets, straight, 1, *common)
    # the same job, sent SIGTERM (what scancel / a preemption sends every task) once its engines are
    # built (the checkpointer has looked for a checkpoint): the flag stops it at a step boundary
    config, *overrides = dpo_args(assets, *common)
    cmd = [sys.executable, "-m", "verl_hpc.submit", config, "--local", "slurm.tasks_per_node=1",
           f"trainer.output_dir={split}", f"slurm.log_dir={split}/logs/%j", *overrides]
    console = tmp_path / "split_console.txt"
    with open(console, "w") as sink:  # a file, not a pipe nobody reads while we wait
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for_text(split / "logs", "**/0/stderr.log", "starting fresh", proc, timeout=400)
            subprocess.run(["pkill", "-TERM", "-f", f"verl_hpc.job {split}"], check=True)
            proc.wait(timeout=300)
        finally:
            proc.kill()
    seen = console.read_text(errors="replace") + "".join(f.read_text(errors="replace") for f in sorted(split.glob("logs/**/0/std*.log")))
    assert proc.returncode == 143, seen[-4000:]  # stopped by a signal to its rank: 128 + SIGTERM's 15
    s1 = json.loads((split / "dpo_summary.json").read_text())
    assert f"stopped early at step {s1['steps']} of {steps}" in seen, seen[-4000:]
    assert s1["stopped"] == "preempted" and 1 <= s1["steps"] < steps, s1
    assert f"preemption flag set after step {s1['steps']}; saving and stopping" in seen, seen[-4000:]
    assert "not requeued" in seen  # not a Slurm job: stopped, told how to resume
    assert (split / "checkpoints" / "latest").read_text().strip() == f"step_{s1['steps']:06d}"
    assert not (split / "hf").exists()  # the export waits for the end of the run
    t0 = time.time()
    proc2, s2 = run_here(config, split, *overrides)  # the same job again (in this process)
    assert proc2.returncode == 0, logs(proc2, split)
    assert s2["resumed_from"] == s1["steps"] and s2["steps"] == steps, s2
    print(f"stopped after step {s1['steps']}, resumed in {time.time() - t0:.0f}s")

    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b) and any(n.startswith("actor/optim/exp_avg/") for n in a)
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, f"not bitwise equal after resume: {differ[:5]}"
    wa, wb = load_file(str(straight / "hf/model.safetensors")), load_file(str(split / "hf/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = stable_rows(straight), stable_rows(split)
    assert [r["step"] for r in rb] == list(range(1, steps + 1)), [r["step"] for r in rb]
    assert ra == rb, next((x, y) for x, y in zip(ra, rb) if x != y)
    # saved under the preference trainer's own format: an RL job refuses to resume from it
    from verl_hpc.checkpoint import read_metadata

    assert read_metadata(split / "checkpoints")["trainer_state"]["format"] == "verl_hpc.preference_trainer/1"
