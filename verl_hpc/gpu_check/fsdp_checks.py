"""The FSDP engine's checks of `python -m verl_hpc.gpu_check`: the second training engine (FSDP2
over the model as transformers builds it) on one GPU, in bf16 mixed precision.

Nothing here imports megatron: a GPU image without megatron-core (or vLLM) runs these checks, and
`tests/unit/test_gpu_check.py` runs them with megatron hidden. The engine is built once
(`fsdp_bf16_logprobs`) and kept on the kit for the step and the export (`fsdp_step_export`),
which frees it; `fsdp_memory_plan` then plans and trains the memory-plan check's job on this
engine (memplan.py).
"""
from __future__ import annotations

import dataclasses
import math

from verl_hpc.gpu_check import workload
from verl_hpc.gpu_check.kit import Kit


def fsdp_options(path: str, rehearsal: bool):
    """The default config's actor on the FSDP engine: bf16 compute over fp32 master weights and
    fp32 gradient reduction on a GPU (fsdp.mixed_precision = bf16), fp32 in a CPU rehearsal."""
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.options import default_options

    # the default model.dtype (float32) in a rehearsal, bf16 on the GPU
    o = default_options(path, engine="fsdp", **({} if rehearsal else {"dtype": "bfloat16"}),
                        micro_batch_size=2, max_tokens_per_microbatch=0, total_steps=4,
                        optim=OptimConfig(lr=1e-3, weight_decay=0.01))
    return dataclasses.replace(o, fsdp=dataclasses.replace(
        o.fsdp, mixed_precision="fp32" if rehearsal else "bf16", compile=False))


def _bound(kit: Kit) -> float:
    return 1e-4 if kit.rehearsal else 0.1  # bf16: two implementations, different kernels


def _compare(kit: Kit, got, ref, batch, what: str) -> str:
    import torch

    mask = torch.arange(ref.shape[1])[None] < batch["response_lengths"][:, None]
    diff = (got.float().cpu() - ref).abs()[mask]
    bound = _bound(kit)
    assert float(diff.max()) < bound, f"{what}: max |diff| = {float(diff.max()):.3g} >= {bound}"
    return f"max |diff| {float(diff.max()):.3g}, mean {float(diff.mean()):.3g} over {int(mask.sum())} tokens"


def fsdp_logprobs(kit: Kit) -> str:
    """The FSDP engine on the GPU (FSDP2 at world size 1, bf16 compute over fp32 master weights)
    against a transformers forward of the same folder in bf16 on the same device (log-probs)."""
    import torch

    from verl_hpc.engines.fsdp import FsdpEngine
    path = workload.tiny_model(kit)
    kit.fsdp_engine = eng = kit.measure("fsdp build", lambda: FsdpEngine(fsdp_options(path, kit.rehearsal)))
    want = torch.float32 if kit.rehearsal else torch.bfloat16
    assert eng.compute_dtype == want, f"compute dtype {eng.compute_dtype}, expected {want}"
    masters = {p.dtype for p in eng.model.parameters()}
    assert masters == {torch.float32}, f"master weights {masters}, expected fp32"
    batch = workload.batch()
    got = kit.measure("fsdp forward (log-probs)", lambda: eng.forward(batch, ("log_probs",)))["log_probs"]
    device = "cpu" if kit.rehearsal else "cuda"
    ref = workload.hf_log_probs(path, batch, getattr(torch, kit.dtype), device)
    detail = _compare(kit, got, ref, batch, "FSDP engine vs transformers")
    return (f"compute {str(eng.compute_dtype).replace('torch.', '')}, fp32 master weights, mesh "
            f"{tuple(eng.mesh.shape)}: {detail} (bound {_bound(kit)})")


def fsdp_step_export(kit: Kit) -> str:
    """One update (clipped AdamW over the DTensor shards), then `export_hf_weights` (what the
    weight sync and the HF export read): the HF names and shapes of the folder, written as an HF
    folder that transformers loads, whose log-probs equal the updated engine's."""
    import shutil

    import torch

    from verl_hpc.models.hf_checkpoint import HFCheckpointReader
    from verl_hpc.models.tiny import save_safetensors

    eng, path = kit.fsdp_engine, kit.model_path
    try:
        before = {n: t.detach().clone() for n, t in eng.export_hf_weights()}
        m = kit.measure("fsdp train step", lambda: eng.train_step(workload.batch(1), workload.loss_fn))
        assert m["nonfinite"] == 0.0 and math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]), m
        after = {n: t.detach().to("cpu").contiguous().clone() for n, t in eng.export_hf_weights()}
        assert set(after) == set(before), "the export's names changed with the update"
        moved = sum(not torch.equal(before[n].cpu(), after[n]) for n in after)
        assert moved > 0, "no exported weight changed"
        source = HFCheckpointReader(path)  # the folder the engine was built from: same names and shapes
        wrong = sorted(n for n in set(after) | set(source.weight_map)
                       if n not in after or n not in source or tuple(after[n].shape) != source.shape(n))
        source.close()
        assert not wrong, f"exported names / shapes differ from the folder's: {wrong[:5]}"
        folder = kit.out / "fsdp_export"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(f"{path}/config.json", folder / "config.json")
        save_safetensors(after, folder)
        batch = workload.batch()
        got = eng.forward(batch, ("log_probs",))["log_probs"]
        ref = workload.hf_log_probs(str(folder), batch, getattr(torch, kit.dtype),
                            "cpu" if kit.rehearsal else "cuda")
        detail = _compare(kit, got, ref, batch, "the exported folder in transformers vs the engine")
    finally:
        kit.fsdp_engine = eng = None  # free it before the next check
    return (f"loss {m['loss']:.4f}, grad norm {m['grad_norm']:.3g}, {moved} of {len(after)} exported tensors "
            f"moved; export -> HF folder -> transformers vs engine: {detail} (bound {_bound(kit)})")


def fsdp_memory_plan(kit: Kit) -> str:
    """The memory plan's prediction for the kit's own job on the FSDP engine (parallel.engine=fsdp:
    fp32 shards, the gathered layers, transformers' activations, logits) against
    max_memory_allocated while that job's actor is built and takes two steps (memplan.run)."""
    from verl_hpc.gpu_check import memplan
    from verl_hpc.gpu_check.kit import NotTestable

    result = memplan.run(kit.out / "plan_llama_fsdp", rehearsal=kit.rehearsal, engine="fsdp")
    if result.measured is None:
        raise NotTestable("CPU rehearsal: no GPU memory to measure (the job was planned and trained on "
                          f"the FSDP engine: {result.describe()})")
    assert result.within, result.describe()
    return result.describe()
