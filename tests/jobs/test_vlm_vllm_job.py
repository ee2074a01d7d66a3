"""GRPO jobs of a vision-language policy rolled out by vLLM (docs/vlm.md, "Rollout and weight sync"): a
tiny Qwen2.5-VL and a tiny Qwen3-VL on the Pillow-drawn visual task, trained on the FSDP engine with
the vision tower training too, the pictures reaching vLLM as multi_modal_data through the trainer's
own path (data -> prompts -> rollout -> update); and the tiny Qwen2.5-VL trained on the Megatron engine
(models/vlm.py: GPTModel with M-RoPE, transformers' tower on the first stage), whose export names
(transformers 5's) reach vLLM's class through the sliced sync with delta.

At every step: the trainer's mismatch metric (the rollout's log-probs of the sampled tokens against
the update's forward on the same tokens and images, rollout/logprob_diff_max) is within the text
models' bound, and the served-weights check after every sync (resharding.check_served_every=1)
reads back every tensor vLLM serves, the trained tower's included. Qwen2.5-VL's syncs are sliced
with delta (on either engine), Qwen3-VL's full. The syncs' three modes against the FSDP engine directly, the encoder
cache and a wrong served tensor: tests/unit/rollout/test_rol_vllm_vision.py.

Runs in the vLLM-range venv only (the marker `torchvision`; make test-vllm-range).
"""
import subprocess
import sys

import pytest

from jobs import MOVING, REPO, logs, metrics, run_here

pytestmark = pytest.mark.torchvision
BOUND = 1e-4  # the text models' bound (tests/unit/rollout/rol_helpers.TOL); measured 5e-7 (FSDP), 9.5e-7 (Megatron)
GRPO = ["rollout.engine=vllm", "trainer.val_every=0", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4", "tracking.backends=[jsonl]",
        "tracking.plots=false", "slurm.cpus_per_task=1", "vision.train_vision_tower=true",
        "resharding.check_served_every=1", "trainer.total_steps=2",
        "actor.old_log_probs=forward"]  # a forward pass of its own: the metric with its max (trainer/stages/correction.py)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_vllm_job")
    subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "visual", str(root / "data"), "--n-train", "16",
                    "--n-val", "6", "--n-sft", "16", "--sft-noise", "0"], cwd=REPO, check=True, capture_output=True)
    return root


SLICED = ["resharding.mode=sliced", "resharding.delta=true"]


@pytest.mark.parametrize("family, overrides", [("qwen2_5_vl", SLICED), ("qwen3_vl", ["resharding.mode=full"]),
                                          ("qwen2_5_vl", ["parallel.engine=megatron", *SLICED])],
                         ids=["qwen2_5_vl", "qwen3_vl", "qwen2_5_vl-megatron"])
def test_grpo_rolls_out_images_on_vllm_within_the_bound(data, tmp_path, family, overrides):
    from safetensors import safe_open

    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    model = make_tiny_vlm(tmp_path / family, family)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        tensors = len(list(f.keys()))
    out = tmp_path / "run"
    proc, summary = run_here("configs/demo_vlm.yaml", out, f"model.path={model}",
                             f"data.train_files=[{data}/data/train.parquet]", f"data.val_files=[{data}/data/val.parquet]",
                             *GRPO, *MOVING, *overrides)
    assert proc.returncode == 0 and summary["steps"] == 2, logs(proc, out)
    rows = [r for r in metrics(out) if "rollout/logprob_diff_max" in r]
    assert [r["step"] for r in rows] == [1, 2]
    gaps = [r["rollout/logprob_diff_max"] for r in rows]
    print(f"{family} {overrides}: rollout vs update log-prob |diff| max per step {gaps}")
    assert max(gaps) < BOUND, gaps
    checked = [(r.get("sync/served_checked"), r.get("sync/served_unplaced")) for r in metrics(out)
               if "sync/served_checked" in r]
    assert len(checked) >= 2 and all(c == (tensors, 0) for c in checked), (tensors, checked)
