"""The memory plan of an fp16 job (model.dtype = float16): on either engine, every phase and
component the bytes of the same job in bf16 (2-byte weights and activations, fp32 master weights,
grads and Adam states; the loss scaler is one number), different from fp32's, and the plan says so:
a note for the dtype, and the FSDP engine's compute named fp16 with its loss scaling."""
from pathlib import Path

import pytest

from verl_hpc.config import load_config
from verl_hpc.planning import plan_job
from verl_hpc.planning.fsdp import compute_bytes, compute_name

REPO = Path(__file__).resolve().parents[3]
GRPO = str(REPO / "configs/grpo_8b.yaml")  # Llama-3-8B, 8 x H100
FSDP = ["parallel.engine=fsdp", "parallel.tp=1", "parallel.sequence_parallel=false", "rollout.tp=1",
        "fsdp.activation_checkpointing=true"]


def _plan(dtype, *overrides):
    return plan_job(load_config(GRPO, [f"model.dtype={dtype}", *overrides]))


@pytest.mark.parametrize("engine", ["megatron", "fsdp"])
def test_fp16_plans_the_bytes_of_bf16_and_says_so(engine):
    extra = FSDP if engine == "fsdp" else []
    fp16, bf16, fp32 = (_plan(d, *extra) for d in ("float16", "bfloat16", "float32"))
    assert fp16.table == bf16.table and fp16.host == bf16.host
    assert fp16.table != fp32.table
    note = [n for n in fp16.notes if n.startswith("model.dtype float16")]
    assert len(note) == 1 and "vLLM and the weight sync in fp16" in note[0]
    assert not any(n.startswith("model.dtype") for n in bf16.notes)
    if engine == "fsdp":
        assert any("compute fp16 with dynamic loss scaling" in n for n in fp16.notes), fp16.notes
        assert any("compute bf16," in n for n in bf16.notes), bf16.notes


def test_fsdp_compute_dtype_follows_the_engines_rule():
    cfg = load_config(GRPO, ["model.dtype=float16", *FSDP])
    assert (compute_name(cfg), compute_bytes(cfg)) == ("fp16", 2)
    cfg.slurm.gpus_per_node = 0  # a CPU job: auto computes in fp32 (engines/fsdp/build.py)
    assert (compute_name(cfg), compute_bytes(cfg)) == ("fp32", 4)
    cfg.fsdp.mixed_precision = "fp16"
    assert (compute_name(cfg), compute_bytes(cfg)) == ("fp16", 2)
