"""Held-out architectures (tests/arch_matrix.py) through a real GRPO job on the FSDP engine, one rank in
this process: folders whose configs name their numbers otherwise (GPT-2's n_head / n_layer, BLOOM),
whose MLP has no intermediate_size (GPT-2, BLOOM, Falcon), whose output layer transformers names
otherwise (GPT-NeoX's embed_out), with sliding-window layers (Gemma 2, Cohere 2), and a GPT-2 that
keeps its pretraining dropout of 0.1 in config.json.

Each runs 2 steps with the HF rollout. At step 1 the rollout and the update's forward see the same
weights: with dropout off in every forward, the rollout's log-probs equal the update's (pi_old is
taken from the update's own forward here, on-policy) within 1e-5, where 85ec11b's GPT-2 left them
apart by dropout (and refused GPT-2 and BLOOM before the queue, and crashed on Falcon's config).
"""
import pytest

from arch_matrix import make_arch
from jobs import MOVING, logs, metrics, run_here, small

TOL = 1e-5


def _job(assets, out, model, *extra):
    return run_here("configs/demo_rl.yaml", out, *small(assets, f"model.path={model}", "parallel.engine=fsdp",
                                                        "trainer.total_steps=2", "data.train_batch_size=2",
                                                        "rollout.n=2", "tracking.backends=[jsonl]",
                                                        "tracking.plots=false", "slurm.cpus_per_task=1",
                                                        *MOVING, *extra))


@pytest.mark.parametrize("arch", ["gpt2", "bloom", "falcon", "gpt_neox", "gemma2", "cohere2"])
def test_grpo_job_on_a_held_out_architecture(arch, tiny_assets, tmp_path, keep_dropout=False):
    model = make_arch(tmp_path / arch, arch, dropout=0.1, tied=arch in ("gpt2", "bloom", "gemma2", "cohere2"))
    out = tmp_path / "out"
    proc, summary = _job(tiny_assets, out, model, "rollout.engine=hf", f"model.disable_dropout={not keep_dropout}")
    assert proc.returncode == 0, logs(proc, out)
    assert summary["steps"] == 2
    first = [r for r in metrics(out) if r.get("step", 0) >= 1][0]
    # the mean over the step's tokens of |rollout - update forward|, from the update's own forward
    assert first["actor/ppo_kl"] == 0.0  # pi_old is that forward's (on-policy)
    assert first["rollout/logprob_diff_mean"] <= TOL, first["rollout/logprob_diff_mean"]
