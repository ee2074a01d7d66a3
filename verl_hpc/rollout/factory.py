"""`build_rollout(cfg, ctx)`: the engine named by `rollout.engine`, configured from the job config."""
from __future__ import annotations

import importlib.util

from verl_hpc.config.schema import choices_of
from verl_hpc.rollout.engine import RolloutEngine

ENGINES = choices_of("rollout.engine")
VLLM_MISSING = ("rollout.engine=vllm but vllm is not installed; install the cpu or gpu extra, "
                "or set rollout.engine=hf")


def engine_kwargs(cfg, engine: str) -> dict:
    """Constructor keywords from a JobConfig (rollout, model and data sections)."""
    r = cfg.rollout
    kwargs = dict(tp=r.tp, dtype=cfg.model.dtype, max_prompt_length=cfg.data.max_prompt_length,
                  max_response_length=r.max_tokens,
                  prompt_overflow=r.prompt_overflow, seed=r.seed,
                  tokenizer_path=cfg.model.tokenizer_path,
                  trust_remote_code=cfg.model.trust_remote_code)
    if engine == "vllm":
        kwargs.update(max_num_seqs=r.max_num_seqs(cfg),
                      gpu_memory_utilization=r.gpu_memory_utilization,
                      kv_cache_memory_bytes=r.kv_cache_memory_bytes, enforce_eager=r.enforce_eager,
                      sleep_between_phases=r.sleep_between_phases, sleep_level=r.sleep_level)
    return kwargs


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_rollout(cfg, ctx=None, **overrides) -> RolloutEngine:
    """VLLMRollout or HFRollout per `rollout.engine`. With several ranks this is collective
    (vLLM engines are built together). `overrides` go to the engine's constructor (e.g.
    logprobs_mode="raw", max_num_seqs=..., batch_size=... for HF)."""
    engine = cfg.rollout.engine
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine={engine!r} is not one of {', '.join(ENGINES)}")
    if not cfg.model.path:
        raise ValueError("model.path is empty: the rollout engine needs a Hugging Face model folder")
    if engine == "vllm":
        if not vllm_available():
            raise RuntimeError(VLLM_MISSING)
        from verl_hpc.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout.from_config(cfg, ctx, **overrides)
    from verl_hpc.rollout.hf_rollout import HFRollout

    return HFRollout.from_config(cfg, ctx, **overrides)
