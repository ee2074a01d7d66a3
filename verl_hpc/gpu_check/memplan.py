"""The memory-plan check: the planner's prediction for the kit's own small job against what torch
allocates on the GPU while that job's actor trains.

One job config (`kit_job_config`) drives both sides: `plan_job(cfg)` predicts the bytes per rank
of the `update_actor` phase, and the engine the check trains is built from the same config
(`engine_options(cfg, "actor")`, verl_hpc/trainer/roles.py). The comparison takes the plan's tensor components of
that phase, the ones the kit's job holds (the actor's weights, gradients and optimizer state, the
activations, the logits); the plan's `overhead` row (CUDA context, NCCL/cuBLAS workspaces,
fragmentation) and vLLM's budget are left out, since max_memory_allocated counts neither.

The model is a small Llama (~20M parameters, vocabulary 8192) with full-length rows of 1024
tokens, so that model state, activations and logits dominate the few fixed allocations (cuBLAS
workspace, the batch) that no plan row names.

`engine="fsdp"` plans and trains the same job on the FSDP engine (parallel.engine=fsdp; bf16
compute over fp32 master weights on a GPU): its plan adds the `gathered` column (the unsharded
layers in flight), which the comparison takes too (0 for Megatron's roles). That path imports
nothing of megatron.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from verl_hpc.config.sections.fsdp import MEGATRON

# PASS band of measured / predicted: the plan may not under-estimate by more than its own
# fragmentation allowance plus the fixed allocations it does not name (a plan that is too low
# lets jobs run out of memory), nor over-estimate by more than 2x (it would refuse jobs that fit).
ABOVE = 0.10
BELOW = 0.50
COMPARED = ("actor", "critic", "ref", "activations", "logits", "gathered")
PHASE = "update_actor"

# the kit's job: full-length rows, so the plan's worst case is what runs
SHAPE = dict(layers=4, vocab_size=8192, hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1408,
             max_positions=2048)
PROMPT, RESPONSE, MICRO_BATCH, ROWS = 256, 768, 2, 4
# --cpu-rehearsal: the same code path, short rows (there is nothing to measure on CPU)
REHEARSAL_PROMPT, REHEARSAL_RESPONSE = 16, 48


def kit_overrides(model_path: str, *, gpu: bool, prompt: int = PROMPT, response: int = RESPONSE,
                  engine: str = MEGATRON) -> List[str]:
    """The kit's job: one rank (dp 1, so the plain optimizer: the engine does not shard at dp 1),
    the actor alone, bf16 on a GPU, on `engine` (parallel.engine)."""
    return [f"model.path={model_path}", f"model.dtype={'bfloat16' if gpu else 'float32'}", f"parallel.engine={engine}",
            f"slurm.gpus_per_node={1 if gpu else 0}", "slurm.nodes=1", "slurm.tasks_per_node=1",
            "parallel.use_distributed_optimizer=false", "ref.enable=false", "critic.enable=false",
            f"data.max_prompt_length={prompt}", f"data.max_response_length={response}",
            f"actor.micro_batch_size={MICRO_BATCH}", "actor.max_tokens_per_microbatch=0"]


def kit_job_config(model_path: str, *, gpu: bool, **kwargs):
    from verl_hpc.config import load_config

    return load_config(None, kit_overrides(model_path, gpu=gpu, **kwargs))


@dataclasses.dataclass(frozen=True)
class Comparison:
    predicted: float  # bytes: the plan's tensor components of PHASE
    measured: Optional[float]  # bytes: max_memory_allocated over build + steps; None on CPU
    parts: Dict[str, float]

    @property
    def ratio(self) -> Optional[float]:
        return None if self.measured is None else self.measured / self.predicted

    @property
    def within(self) -> bool:
        r = self.ratio
        return r is not None and BELOW <= r <= 1.0 + ABOVE

    def describe(self) -> str:
        mib = 2 ** 20
        parts = ", ".join(f"{k} {v / mib:.0f}" for k, v in self.parts.items() if v)
        text = f"plan {PHASE} {self.predicted / mib:.0f} MiB ({parts} MiB)"
        if self.measured is None:
            return text
        return (f"{text}; measured max_memory_allocated {self.measured / mib:.0f} MiB = "
                f"{self.ratio:.2f} x the plan (PASS band {BELOW:.2f}..{1 + ABOVE:.2f})")


def predicted(plan) -> Dict[str, float]:
    row = plan.table[PHASE]
    return {c: float(row.get(c, 0.0)) for c in COMPARED}


def compare(plan, measured: Optional[float]) -> Comparison:
    parts = predicted(plan)
    return Comparison(predicted=sum(parts.values()), measured=measured, parts=parts)


def run(folder, *, rehearsal: bool, engine: str = MEGATRON) -> Comparison:
    """Plan the kit's job and train its actor on `engine` for two steps (the second has Adam's
    state, as every step of a run does) on this machine; the comparison (measured None in a CPU
    rehearsal)."""
    import gc
    import math

    from verl_hpc.gpu_check import workload
    from verl_hpc.models.gpt import transformer_engine_available
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.planning import plan_job
    from verl_hpc.runtime.device import memory_allocated, peak_memory_allocated, reset_peak_memory
    from verl_hpc.trainer.roles import engine_options

    path = str(make_tiny_model(folder, "llama", **SHAPE))
    lengths = (dict(prompt=REHEARSAL_PROMPT, response=REHEARSAL_RESPONSE) if rehearsal
               else dict(prompt=PROMPT, response=RESPONSE))
    cfg = kit_job_config(path, gpu=not rehearsal, engine=engine, **lengths)
    # the layer spec this machine builds: a GPU node without Transformer Engine runs the local spec
    # (the FSDP engine builds transformers' layers whatever is installed)
    te = engine == "megatron" and transformer_engine_available()
    plan = plan_job(cfg, layer_impl="te" if te else "local")
    gc.collect()
    base = memory_allocated() or 0  # what the earlier checks still hold
    reset_peak_memory()
    if engine == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine as Engine
    else:
        from verl_hpc.engines.megatron import MegatronEngine as Engine
    eng = Engine(engine_options(cfg, "actor"))
    for k in range(2):
        m = eng.train_step(workload.batch(k, rows=ROWS, full=True, **lengths), workload.loss_fn)
        assert m["nonfinite"] == 0.0 and math.isfinite(m["loss"]), m
    peak = peak_memory_allocated()
    del eng
    gc.collect()
    return compare(plan, None if peak is None or rehearsal else peak - base)
