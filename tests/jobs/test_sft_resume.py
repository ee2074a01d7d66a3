"""SFT on every program's loop: Slurm's warning signal after a step saves it and stops; the job run
again resumes from `latest` and ends bitwise where the uninterrupted run ends (weights, Adam
moments, the HF folder, every per-step loss). One rank in this process; the real signal through
Slurm, requeue included, is tests/slurm/test_sft_preemption.py."""
import signal

import pytest
import torch

from jobs import data_overrides, logs, read_all, run_here, stable_metrics

pytestmark = pytest.mark.no_vllm("SFT: no rollout")


def sft(root, out, *extra):
    return run_here("configs/demo_sft.yaml", out, f"model.path={root}/model", *data_overrides(root),
                    "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=8",
                    "actor.optim.warmup_steps=2", "trainer.total_steps=6", "tracking.backends=[jsonl]",
                    "tracking.plots=false", f"trainer.hf_output_dir={out}/hf", *extra)


def test_sft_preempted_by_the_warning_signal_resumes_bitwise(tiny_assets, tmp_path, monkeypatch):
    from verl_hpc.runtime.signals import WARNING_SIGNAL
    from verl_hpc.trainer.programs import sft as sft_program

    straight, split = tmp_path / "straight", tmp_path / "split"
    proc, s = sft(tiny_assets, straight)
    assert proc.returncode == 0 and s["steps"] == 6 and s["stopped"] == "completed", logs(proc, straight)

    step = sft_program.SFT.step

    def signalled_after_3(self, n, timer):  # Slurm's warning signal while step 3 runs
        out = step(self, n, timer)
        if n == 3:
            signal.raise_signal(WARNING_SIGNAL)
        return out

    monkeypatch.setattr(sft_program.SFT, "step", signalled_after_3)
    proc, s1 = sft(tiny_assets, split)
    assert proc.returncode == 0, logs(proc, split)  # not a Slurm job: stops, says how to resume
    assert s1["stopped"] == "preempted" and s1["steps"] == 3, s1
    assert "preemption flag set after step 3; saving and stopping" in logs(proc, split)
    assert not (split / "hf").exists()  # a preempted run exports when the resumed job finishes
    monkeypatch.setattr(sft_program.SFT, "step", step)

    proc, s2 = sft(tiny_assets, split)
    assert proc.returncode == 0 and s2["resumed_from"] == 3 and s2["steps"] == 6, logs(proc, split)
    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b) and any(n.startswith("actor/optim/exp_avg/") for n in a)
    assert not [n for n in a if not torch.equal(a[n], b[n])], "not bitwise equal after the resume"
    ha, hb = read_all_hf(straight / "hf"), read_all_hf(split / "hf")
    assert sorted(ha) == sorted(hb) and all(torch.equal(ha[n], hb[n]) for n in ha)
    ma, mb = stable_metrics(straight), stable_metrics(split)
    assert [m["step"] for m in mb] == [1, 2, 3, 4, 5, 6] and ma == mb


def read_all_hf(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))
