"""An engine's constructor keywords from the job config. Its own module so that the engines, which
read it in `from_config`, never import the factory that builds them (the factory imports them)."""
from __future__ import annotations

from verl_hpc.runtime import device as devices


def engine_kwargs(cfg, engine: str) -> dict:
    """Constructor keywords from a JobConfig (rollout, model and data sections)."""
    r = cfg.rollout
    kwargs = dict(tp=r.tp, dtype=cfg.model.dtype, max_prompt_length=cfg.data.max_prompt_length,
                  max_response_length=r.window(cfg),  # multi_turn: the whole episode
                  prompt_overflow=r.prompt_overflow, seed=r.seed,
                  tokenizer_path=cfg.model.tokenizer_path,
                  trust_remote_code=cfg.model.trust_remote_code)
    if engine == "vllm":
        gpu = devices.has_gpu()  # the rank's machine: what the rollout section's auto switches follow
        kwargs.update(max_num_seqs=r.max_num_seqs(cfg),
                      gpu_memory_utilization=r.gpu_memory_utilization,
                      collective_timeout_s=cfg.trainer.collective_timeout_s,
                      kv_cache_memory_bytes=r.kv_cache_memory_bytes, enforce_eager=r.eager(gpu),
                      sleep_between_phases=r.sleeps(gpu, cfg.placement.split),
                      # level 2 drops the base weights, which the adapter sync never sends again
                      sleep_level=1 if lora_slot_rank(cfg) else r.sleep_level,
                      lora_rank=lora_slot_rank(cfg))
    return kwargs


def lora_slot_rank(cfg) -> int:
    """The adapter rank vLLM's LoRA slot must take (0: none): lora.rank when the job syncs the
    adapter only (lora.sync, resolved for this rank's machine), else 0 (merged weights need no slot)."""
    return cfg.lora.rank if cfg.lora.syncs_adapter(cfg, "vllm", gpu=devices.has_gpu()) else 0


def default_engine_args(engine: str, **changes) -> dict:
    """The constructor keywords VLLMRollout / HFRollout require (engine "vllm" / "hf"), from the
    default config's sections, with `changes` on top: for code that builds an engine without a job
    config (tests, benchmarks). Jobs go through from_config (engine_kwargs)."""
    from verl_hpc.config import JobConfig  # lazily, as rollout/spec.py's default_spec

    cfg = JobConfig()
    cfg.rollout.resolve(cfg)  # the auto values (a colocated job's)
    args = dict(dtype=cfg.model.dtype, max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=cfg.data.max_response_length, prompt_overflow=cfg.rollout.prompt_overflow)
    if engine == "vllm":
        args.update(gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                    collective_timeout_s=cfg.trainer.collective_timeout_s)
    return dict(args, **changes)
