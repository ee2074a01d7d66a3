"""What a rollout engine is built from: `RolloutOptions` (the rollout and model sections and the
values of other sections the engines read), and the engine's constructor keywords from them. Its own
module so that the engines, which read it in `from_options`, never import the factory that builds
them (the factory imports them). The trainer builds the options from the job config
(verl_hpc/trainer/roles.py: rollout_options)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_hpc.runtime import device as devices


@dataclass(frozen=True)
class RolloutOptions:
    """The rollout engine's sections, and each value it reads from another section, named by the
    field it comes from."""
    rollout: Any  # the rollout section
    model: Any  # the model section
    max_prompt_length: int  # data.max_prompt_length
    window: int  # rollout.window: tokens generated after a prompt (multi_turn: the whole episode)
    max_num_seqs: int  # rollout.max_num_seqs: sequences one rollout call has in flight
    collective_timeout_s: int  # trainer.collective_timeout_s
    split: bool  # placement.split
    lora_rank: int  # the rank of vLLM's LoRA slot: lora.rank when the job syncs the adapter only, else 0
    episodes: bool = False  # multi_turn.enable: responses that copy tool output (rollout.speculative auto)
    decode_tokens: int = 0  # rollout.decode_tokens: what the job samples (rollout.enforce_eager auto on CPU); 0: unknown
    compile_cache: str = ""  # trainer.output_dir's cache/compile: vLLM's compilation kept across restarts ("": vLLM's own)


def engine_kwargs(o: RolloutOptions, engine: str) -> dict:
    """Constructor keywords of `engine` ("vllm" or "hf") from the options."""
    r, m = o.rollout, o.model
    kwargs = dict(tp=r.tp, dtype=m.dtype, max_prompt_length=o.max_prompt_length,
                  max_response_length=o.window,  # multi_turn: the whole episode
                  prompt_overflow=r.prompt_overflow, seed=r.seed,
                  tokenizer_path=m.tokenizer_path,
                  trust_remote_code=m.trust_remote_code,
                  speculative=getattr(r, "speculative", None))  # rollout/speculative/config.py
    if engine == "hf":  # routing replay R3: the rollout records each token's experts
        kwargs["record_routes"] = getattr(m, "moe_routing_replay", "off") == "rollout"
    if engine == "vllm":
        gpu = devices.has_gpu()  # the rank's machine: what the rollout section's auto switches follow
        kwargs.update(max_num_seqs=o.max_num_seqs,
                      gpu_memory_utilization=r.gpu_memory_utilization,
                      collective_timeout_s=o.collective_timeout_s,
                      kv_cache_memory_bytes=r.kv_cache_memory_bytes,
                      enforce_eager=r.eager(gpu, o.decode_tokens, model_layers(m.path)),
                      compile_cache_dir=o.compile_cache,
                      sleep_between_phases=r.sleeps(gpu, o.split),
                      chunked_prefill=r.chunked_prefill(gpu), max_num_batched_tokens=r.max_num_batched_tokens,
                      # level 2 drops the base weights, which the adapter sync never sends again
                      sleep_level=1 if o.lora_rank else r.sleep_level,
                      lora_rank=o.lora_rank, episodes=o.episodes,
                      quantization=r.quantization, kv_cache_dtype=r.kv_cache_dtype,  # rollout/vllm/quantization.py
                      stall_timeout_s=r.stall_timeout_s)  # rollout/vllm/progress.py
    return kwargs


def model_layers(path: str) -> int:
    """The language model's decoder layers from the folder's config.json; 0 where it cannot be read
    (rollout.enforce_eager auto then stays eager on CPU)."""
    from verl_hpc.config.hf_model import language_model_config, read_hf_config

    try:
        return int(language_model_config(read_hf_config(path)).get("num_hidden_layers") or 0)
    except Exception:  # noqa: BLE001 - a folder the engine's own build will name
        return 0


def default_engine_args(engine: str, **changes) -> dict:
    """The constructor keywords VLLMRollout / HFRollout require (engine "vllm" / "hf"), from the
    default config's sections, with `changes` on top: for code that builds an engine without a job
    config (tests, benchmarks). Jobs go through from_options (engine_kwargs)."""
    from verl_hpc.config import JobConfig  # lazily, as rollout/sampling.py's default_spec

    cfg = JobConfig()
    cfg.rollout.resolve(cfg)  # the auto values (a colocated job's)
    args = dict(dtype=cfg.model.dtype, max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=cfg.data.max_response_length, prompt_overflow=cfg.rollout.prompt_overflow)
    if engine == "vllm":
        args.update(gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                    collective_timeout_s=cfg.trainer.collective_timeout_s)
    return dict(args, **changes)
