"""GRPO of a tiny Qwen2.5-VL trained on the Megatron engine (models/vlm.py: Megatron's GPTModel with
M-RoPE, transformers' vision tower on the first stage) and rolled out by vLLM's own Qwen2.5-VL class,
the tower training too: the engine's export names (transformers 5's) reach vLLM through the sliced
sync with delta, and the served-weights check after every sync reads back every tensor vLLM serves;
at every step the rollout's log-probs of the sampled tokens equal the update's forward on the same
tokens and images within the text models' bound. The FSDP engine's run of the same:
tests/jobs/test_vlm_vllm_job.py.

Runs in the vLLM-range venv only (the marker `torchvision`; make test-vllm-range).
"""
import subprocess
import sys

import pytest

from jobs import MOVING, REPO, logs, metrics, run_here

pytestmark = pytest.mark.torchvision
BOUND = 1e-4  # the text models' bound (tests/unit/rollout/rol_helpers.TOL); measured 9.5e-7
GRPO = ["rollout.engine=vllm", "parallel.engine=megatron", "trainer.val_every=0", "data.train_batch_size=4",
        "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4", "tracking.backends=[jsonl]",
        "tracking.plots=false", "slurm.cpus_per_task=1", "vision.train_vision_tower=true",
        "resharding.check_served_every=1", "trainer.total_steps=2", "resharding.mode=sliced", "resharding.delta=true",
        "actor.old_log_probs=forward"]  # a forward pass of its own: the metric with its max


def test_megatron_vlm_rolls_out_on_vllm_within_the_bound(tmp_path):
    from safetensors import safe_open

    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "visual", str(tmp_path / "data"), "--n-train", "16",
                    "--n-val", "6", "--n-sft", "16", "--sft-noise", "0"], cwd=REPO, check=True, capture_output=True)
    model = make_tiny_vlm(tmp_path / "qwen2_5_vl", "qwen2_5_vl")
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        tensors = len(list(f.keys()))
    out = tmp_path / "run"
    proc, summary = run_here("configs/demo_vlm.yaml", out, f"model.path={model}",
                             f"data.train_files=[{tmp_path}/data/train.parquet]",
                             f"data.val_files=[{tmp_path}/data/val.parquet]", *GRPO, *MOVING)
    assert proc.returncode == 0 and summary["steps"] == 2, logs(proc, out)
    rows = [r for r in metrics(out) if "rollout/logprob_diff_max" in r]
    assert [r["step"] for r in rows] == [1, 2]
    gaps = [r["rollout/logprob_diff_max"] for r in rows]
    print(f"Megatron Qwen2.5-VL: rollout vs update log-prob |diff| max per step {gaps}")
    assert max(gaps) < BOUND, gaps
    checked = [(r.get("sync/served_checked"), r.get("sync/served_unplaced")) for r in metrics(out)
               if "sync/served_checked" in r]
    assert len(checked) >= 2 and all(c == (tensors, 0) for c in checked), (tensors, checked)
