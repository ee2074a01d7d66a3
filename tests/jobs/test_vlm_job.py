"""Vision-language jobs end to end in this process (docs/vlm.md): a tiny Qwen2.5-VL
(verl_hpc/models/tiny_vlm.py) on the Pillow-drawn visual task (verl_hpc/data/prepare/visual.py),
trained on the FSDP engine and on the Megatron engine (its language model as Megatron's GPTModel
with M-RoPE, transformers' vision tower beside it: models/vlm.py) with the images in every rollout
and update.

- GRPO resumes exactly with images in the batch: 3 steps straight vs 2, stop, resume, 1 more give
  bitwise the same checkpoint (weights, Adam moments; the frozen vision tower's weights, which have
  no moments) and the same per-step metrics; and the update sees the images the rollout saw: its
  log-probs equal the rollout's at every step (an update whose mini-batches dropped the images
  read the image tokens as text, 0.35-0.95 nats off);
- the HF rollout holds the trained weights after each sync (bitwise the engine's export);
- the SFT warm start with images exports a folder that loads and answers image prompts
  (greedy_eval's VLM path).
"""
import subprocess
import sys

import pytest
import torch

from jobs import MOVING, REPO, logs, read_all, run_here, stable_metrics

GRPO = ["rollout.engine=hf", "trainer.val_every=0", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4", "tracking.backends=[jsonl]",
        "tracking.plots=false", "slurm.cpus_per_task=1", "vision.train_vision_tower=false"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    root = tmp_path_factory.mktemp("vlm_job")
    make_tiny_vlm(root / "model", "qwen2_5_vl")
    subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "visual", str(root / "data"), "--n-train", "16",
                    "--n-val", "6", "--n-sft", "16", "--sft-noise", "0"], cwd=REPO, check=True, capture_output=True)
    return root


def _files(root):
    return [f"model.path={root}/model", f"data.train_files=[{root}/data/train.parquet]",
            f"data.val_files=[{root}/data/val.parquet]"]


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_grpo_with_images_resumes_exactly(assets, tmp_path, engine):
    straight, split = tmp_path / "straight", tmp_path / "split"
    job = [*_files(assets), *GRPO, *MOVING, f"parallel.engine={engine}"]
    proc, _ = run_here("configs/demo_vlm.yaml", straight, *job, "trainer.total_steps=3")
    assert proc.returncode == 0, logs(proc, straight)
    proc, _ = run_here("configs/demo_vlm.yaml", split, *job, "trainer.total_steps=2", "checkpoint.save_every=1")
    assert proc.returncode == 0, logs(proc, split)
    proc, s = run_here("configs/demo_vlm.yaml", split, *job, "trainer.total_steps=3")
    assert proc.returncode == 0 and s["resumed_from"] == 2, logs(proc, split)
    from verl_hpc.checkpoint import open_checkpoint

    with open_checkpoint(straight / "checkpoints" / "step_000003") as r:  # the engine asked for trained it
        assert r.metadata["trainer_state"]["engines"]["actor"]["format"] == f"verl_hpc.{engine}_engine/1"
    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b)
    vision = [n for n in a if "/visual." in n]  # Megatron's coordinates on both engines: actor/model/visual.*
    assert vision and not any("exp_avg" in n for n in vision), "the frozen tower: weights, no moments"
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    start = read_all(split / "checkpoints" / "step_000002")
    moved = [n for n in a if n.startswith("actor/model/") and not torch.equal(start[n], a[n])]
    assert moved and not any("/visual." in n for n in moved)
    ma, mb = stable_metrics(straight), stable_metrics(split)
    assert [m["step"] for m in mb] == [1, 2, 3] and ma == mb
    gaps = [m["rollout/logprob_diff_mean"] for m in ma]
    assert len(gaps) == 3 and max(gaps) < 1e-4, gaps


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_the_rollout_holds_the_trained_weights(assets, tmp_path, engine):
    """After each step's sync the HF rollout's parameters are the engine's export, bitwise (the
    Megatron engine's under transformers 5's names, which the rollout's model has)."""
    from verl_hpc.trainer.programs import rl

    seen = []
    original = rl.RLTrainer.step

    def step(self, n, timer):
        out = original(self, n, timer)
        self.rollout_weights.ready(timer)
        want = dict(self.roles.actor.engine.export_hf_weights())
        got = self.roles.rollout.model.state_dict()
        assert sorted(want) == sorted(got)
        seen.append([name for name in want if not torch.equal(got[name], want[name])])
        return out

    rl.RLTrainer.step = step
    try:
        proc, _ = run_here("configs/demo_vlm.yaml", tmp_path, *_files(assets), *GRPO, *MOVING, "trainer.total_steps=2",
                           f"parallel.engine={engine}")
    finally:
        rl.RLTrainer.step = original
    assert proc.returncode == 0, logs(proc, tmp_path)
    assert seen == [[], []]


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_sft_with_images_exports_a_folder_that_answers_image_prompts(assets, tmp_path, engine):
    from verl_hpc.trainer.programs.greedy_eval import greedy_answers

    hf = tmp_path / "hf"
    proc, s = run_here("configs/demo_vlm_sft.yaml", tmp_path, *_files(assets), f"data.sft_files=[{assets}/data/sft.parquet]",
                       "trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=8",
                       "tracking.backends=[jsonl]", "tracking.plots=false", f"trainer.hf_output_dir={hf}",
                       f"parallel.engine={engine}")
    assert proc.returncode == 0 and s["steps"] == 2, logs(proc, tmp_path)
    assert (hf / "preprocessor_config.json").is_file()
    answers = greedy_answers(str(hf), str(assets / "data" / "val.parquet"), 4, "prompt", True)
    assert len(answers) == 6 and all(isinstance(text, str) for _, text in answers)
