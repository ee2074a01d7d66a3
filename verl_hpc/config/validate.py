"""Semantic checks of a loaded config: value ranges, the parallel layout, and the model's shape.

`validate` collects every problem it finds and raises them together (one line each), so that a
user fixes a config in one round. Each line names the fields involved and what would be valid.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Iterator, List, NamedTuple, Tuple

from verl_hpc.config.errors import ConfigError, choice_message, raise_if_any
from verl_hpc.config.schema import GROUP_ESTIMATORS, JobConfig, critic_enabled


# ---------------------------------------------------------------------------------- choices
def _fields(obj, prefix: str = "") -> Iterator[Tuple[str, object, dict]]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value, f.metadata


def check_choices(cfg: JobConfig) -> List[str]:
    """One problem per field whose value is not among its valid names (list fields: per item)."""
    problems: List[str] = []
    recipes = None
    for key, value, meta in _fields(cfg):
        valid = meta.get("choices")
        if "choices_from" in meta:
            if recipes is None:
                from verl_hpc.config.loader import recipes_module

                recipes = recipes_module()
            valid = tuple(getattr(recipes, meta["choices_from"]))
        if valid is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if item is not None and item not in valid:
                problems.append(choice_message(key, item, valid))
    return problems


# ---------------------------------------------------------------------------------- ranges
_POSITIVE = [
    "data.max_prompt_length", "data.max_response_length", "data.train_batch_size", "data.val_batch_size",
    "actor.ppo_epochs", "actor.ppo_mini_batch_size", "actor.micro_batch_size",
    "critic.ppo_epochs", "critic.ppo_mini_batch_size", "critic.micro_batch_size",
    "rollout.n", "rollout.tp", "rollout.bucket_mb", "trainer.total_steps", "trainer.collective_timeout_s",
    "trainer.max_nonfinite_in_a_row", "trainer.smoke.steps", "parallel.tp", "parallel.pp",
    "slurm.nodes", "slurm.tasks_per_node", "slurm.cpus_per_task", "slurm.time_min",
    "tracking.log_every", "algorithm.kl_ctrl.horizon", "algorithm.max_num_gen_batches",
]
_NON_NEGATIVE = [
    "actor.max_tokens_per_microbatch", "critic.max_tokens_per_microbatch", "actor.optim.warmup_steps",
    "critic.optim.warmup_steps", "rollout.max_tokens", "rollout.kv_cache_memory_bytes",
    "trainer.val_every", "checkpoint.save_every", "checkpoint.keep_last", "slurm.gpus_per_node",
    "slurm.mem_gb", "slurm.signal_delay_s", "algorithm.overlong_buffer.len",
    "algorithm.overlong_buffer.penalty_factor", "algorithm.kl_ctrl.kl_coef", "actor.kl_loss_coef",
    "rollout.temperature", "rollout.val_temperature", "trainer.smoke.step_seconds",
    "actor.optim.weight_decay", "critic.optim.weight_decay", "actor.optim.clip_grad",
    "critic.optim.clip_grad", "actor.optim.lr", "critic.optim.lr", "actor.optim.min_lr",
    "critic.optim.min_lr", "reward.timeout_s", "trainer.stage_timeout_s",
]
# (key, interval): "[" / "]" include the bound, "(" / ")" exclude it
_RANGES = [
    ("actor.clip_ratio_low", "[0, 1)"),
    ("rollout.top_p", "(0, 1]"),
    ("rollout.gpu_memory_utilization", "(0, 1]"),
    ("algorithm.gamma", "[0, 1]"),
    ("algorithm.lam", "[0, 1]"),
    ("tracking.prometheus_port", "[0, 65535]"),
]


def _in(v, interval: str) -> bool:
    low, high = (float(x) for x in interval[1:-1].split(","))
    above = v > low if interval[0] == "(" else v >= low
    below = v < high if interval[-1] == ")" else v <= high
    return above and below


def get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _ranges(cfg: JobConfig) -> List[str]:
    # NaN passes every comparison below, and YAML accepts .nan / .inf: reject them first.
    p = [f"{k}: must be a finite number, got {v}" for k, v, _ in _fields(cfg)
         if isinstance(v, float) and not math.isfinite(v)]
    p += [f"{k}: must be > 0, got {get(cfg, k)}" for k in _POSITIVE if get(cfg, k) <= 0]
    p += [f"{k}: must be >= 0, got {get(cfg, k)}" for k in _NON_NEGATIVE if get(cfg, k) < 0]
    p += [f"{k}: must be in {i}, got {get(cfg, k)}" for k, i in _RANGES if not _in(get(cfg, k), i)]
    a = cfg.actor
    if a.clip_ratio_high <= 0:
        p.append(f"actor.clip_ratio_high: must be > 0, got {a.clip_ratio_high}")
    if a.clip_ratio_c <= 1:
        p.append(f"actor.clip_ratio_c: the dual-clip bound must be > 1, got {a.clip_ratio_c}")
    if cfg.critic.cliprange_value <= 0:
        p.append(f"critic.cliprange_value: must be > 0, got {cfg.critic.cliprange_value}")
    if cfg.rollout.top_k != -1 and cfg.rollout.top_k <= 0:
        p.append(f"rollout.top_k: must be -1 (off) or > 0, got {cfg.rollout.top_k}")
    for role in ("actor", "critic"):
        o = get(cfg, f"{role}.optim")
        if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
            p.append(f"{role}.optim.betas: must be two numbers in [0, 1), got {o.betas}")
        if o.eps <= 0:
            p.append(f"{role}.optim.eps: must be > 0, got {o.eps}")
        if o.min_lr > o.lr:
            p.append(f"{role}.optim.min_lr = {o.min_lr} is above {role}.optim.lr = {o.lr}")
    if cfg.parallel.vpp is not None and cfg.parallel.vpp <= 0:
        p.append(f"parallel.vpp: must be > 0 (or null), got {cfg.parallel.vpp}")
    weights = cfg.data.mixture.values()
    if any(w < 0 for w in weights) or (weights and sum(weights) <= 0):
        p.append(f"data.mixture: weights must be >= 0 with a positive sum, got {cfg.data.mixture}")
    return p


# ---------------------------------------------------------------------------------- layout
def _layout(cfg: JobConfig) -> List[str]:
    s, par, world = cfg.slurm, cfg.parallel, cfg.world_size
    formed = f"the world size {world} (slurm.nodes {s.nodes} * slurm.tasks_per_node {s.tasks_per_node})"
    p: List[str] = []
    mp = par.tp * par.pp
    if world > 0 and mp > 0 and world % mp:
        p.append(f"parallel.tp * parallel.pp = {par.tp} * {par.pp} = {mp} does not divide {formed}")
    if world > 0 and cfg.rollout.tp > 0 and world % cfg.rollout.tp:
        p.append(f"rollout.tp = {cfg.rollout.tp} does not divide {formed}")
    if s.gpus_per_node > 0 and s.tasks_per_node > s.gpus_per_node:
        p.append(f"slurm.tasks_per_node = {s.tasks_per_node} is more than slurm.gpus_per_node = "
                 f"{s.gpus_per_node}: more ranks than GPUs requested (one rank per GPU)")
    if s.gpus_per_node == 0 and par.backend == "nccl":
        p.append("parallel.backend = nccl needs GPUs, but slurm.gpus_per_node = 0 (a CPU job): use gloo or auto")
    if s.gpus_per_node == 0 and cfg.model.fp8:
        p.append("model.fp8 needs GPUs (Transformer Engine), but slurm.gpus_per_node = 0 (a CPU job)")
    if par.vpp is not None and par.pp <= 1:
        p.append(f"parallel.vpp = {par.vpp} needs parallel.pp > 1 (got {par.pp}): it interleaves pipeline stages")
    if par.sequence_parallel and par.tp <= 1:
        p.append(f"parallel.sequence_parallel needs parallel.tp > 1 (got {par.tp}): it splits activations "
                 "across the tensor-parallel group")
    if s.time_min > 0 and s.signal_delay_s >= s.time_min * 60:
        p.append(f"slurm.signal_delay_s = {s.signal_delay_s} is not shorter than slurm.time_min = "
                 f"{s.time_min} minutes")
    if s.container.runtime != "none" and not s.container.image:
        p.append(f"slurm.container.image: empty, but slurm.container.runtime = {s.container.runtime} needs one")
    if world > 0 and mp > 0 and world % mp == 0 and cfg.trainer.job != "smoke":  # smoke: no batches
        p += _batches(cfg, world // mp, f"the data-parallel size {world // mp} (world size {world} / "
                                        f"(parallel.tp {par.tp} * parallel.pp {par.pp}))")
    return p


def _batches(cfg: JobConfig, dp: int, dp_words: str) -> List[str]:
    d, rl = cfg.data, cfg.trainer.job == "rl"
    n = cfg.rollout.n if rl else 1  # sft trains on the dataset's responses
    if min(d.train_batch_size, n) <= 0:
        return []  # reported as ranges
    p: List[str] = []
    if (d.train_batch_size * n) % dp:
        p.append(f"data.train_batch_size * rollout.n = {d.train_batch_size} * {n} = {d.train_batch_size * n} "
                 f"responses per step is not divisible by {dp_words}")
    roles = ["actor"] + (["critic"] if rl and critic_enabled(cfg) else [])
    for role in roles:
        r = get(cfg, role)
        mb, micro, budget = r.ppo_mini_batch_size, r.micro_batch_size, r.max_tokens_per_microbatch
        if mb <= 0 or micro <= 0:
            continue
        per_rank = mb * n // dp
        if (d.train_batch_size * n) % dp:
            pass  # reported above for the whole step; its mini batches cannot split evenly either
        elif d.train_batch_size % mb:
            p.append(f"{role}.ppo_mini_batch_size = {mb} does not divide data.train_batch_size = {d.train_batch_size}")
        elif (mb * n) % dp:
            p.append(f"{role}.ppo_mini_batch_size * rollout.n = {mb} * {n} = {mb * n} sequences per optimizer "
                     f"step is not divisible by {dp_words}")
        elif budget == 0 and per_rank % micro:
            verb = "is more than" if micro > per_rank else "does not divide"
            p.append(f"{role}.micro_batch_size = {micro} {verb} the {per_rank} sequence(s) each rank "
                     f"gets per optimizer step ({role}.ppo_mini_batch_size * rollout.n / {dp} ranks)")
        seq = d.max_prompt_length + d.max_response_length
        if 0 < budget < seq:
            p.append(f"{role}.max_tokens_per_microbatch = {budget} is smaller than one full sequence "
                     f"(data.max_prompt_length + data.max_response_length = {seq})")
    return p


# ---------------------------------------------------------------------------------- algorithm, job
def _algorithm(cfg: JobConfig) -> List[str]:
    """Only for trainer.job == rl: what the RL step needs from the algorithm fields."""
    alg, d, p = cfg.algorithm, cfg.data, []
    if alg.adv_estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        p.append(f"rollout.n = {cfg.rollout.n}: algorithm.adv_estimator = {alg.adv_estimator} compares the "
                 "responses to one prompt and needs rollout.n >= 2")
    if alg.filter_groups and cfg.rollout.n < 2:
        p.append(f"algorithm.filter_groups needs rollout.n >= 2 (got {cfg.rollout.n})")
    if cfg.critic.enable is False and alg.adv_estimator == "gae":
        p.append("critic.enable = false, but algorithm.adv_estimator = gae needs a critic: "
                 "set critic.enable=true (or leave it null) or pick another estimator")
    kl_users = [k for k, on in (("algorithm.use_kl_in_reward", alg.use_kl_in_reward),
                                ("actor.use_kl_loss", cfg.actor.use_kl_loss)) if on]
    if cfg.ref.enable is False and kl_users:
        p.append(f"ref.enable = false, but {' and '.join(kl_users)} needs the reference policy")
    if cfg.rollout.max_tokens > d.max_response_length:
        p.append(f"rollout.max_tokens = {cfg.rollout.max_tokens} exceeds data.max_response_length = "
                 f"{d.max_response_length}")
    ob = alg.overlong_buffer
    if ob.enable and not 0 < ob.len < d.max_response_length:
        p.append(f"algorithm.overlong_buffer.len = {ob.len} must be in (0, data.max_response_length = "
                 f"{d.max_response_length}) when algorithm.overlong_buffer.enable is true")
    return p


def _job(cfg: JobConfig) -> List[str]:
    t, r, p = cfg.trainer, cfg.reward, []
    if r.custom_function and not r.allow_custom_code:
        p.append(f"reward.custom_function = '{r.custom_function}' runs your own code: set "
                 "reward.allow_custom_code=true to allow it")
    module, _, fn = r.custom_function.partition(":")
    if r.custom_function and not (module and fn):
        p.append(f"reward.custom_function = '{r.custom_function}': expected 'package.module:function'")
    if r.reward_model.enable and not r.reward_model.path:
        p.append("reward.reward_model.path: empty, but reward.reward_model.enable is true")
    if t.resume not in ("auto", "never") and not os.path.exists(t.resume):
        p.append(f"trainer.resume: no such checkpoint '{t.resume}'; valid: auto, never, or an existing path")
    if t.job in ("rl", "sft") and not cfg.model.path:
        p.append(f"model.path: empty, but trainer.job = {t.job} needs a Hugging Face model folder")
    if t.job == "rl" and not cfg.data.train_files:
        p.append(f"data.train_files: empty, but trainer.job = {t.job} needs at least one prompt file")
    if t.job == "sft" and not cfg.data.sft_files:
        p.append("data.sft_files: empty, but trainer.job = sft needs at least one file with prompt and "
                 f"{cfg.data.response_key} columns")
    if t.max_nonfinite_in_a_row < 1:
        p.append(f"trainer.max_nonfinite_in_a_row = {t.max_nonfinite_in_a_row}: must be >= 1")
    if t.smoke.fail_rank >= max(cfg.world_size, 1):
        p.append(f"trainer.smoke.fail_rank = {t.smoke.fail_rank} is not a rank of this job "
                 f"(world size {cfg.world_size})")
    if t.smoke.fail_rank >= 0 and t.smoke.fail_at_step < 0:
        p.append("trainer.smoke.fail_at_step must be >= 0 when trainer.smoke.fail_rank is set")
    if "prometheus" in cfg.tracking.backends and cfg.tracking.prometheus_port <= 0:
        p.append("tracking.prometheus_port: must be > 0 when tracking.backends includes prometheus")
    return p


# ---------------------------------------------------------------------------------- sbatch text
_SBATCH_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # newlines, NUL, escapes (tab is harmless)


def _control(value: str) -> str:
    m = _CONTROL.search(value)
    return f"character {m.group()!r}" if m else ""


def _sbatch_text(cfg: JobConfig) -> List[str]:
    """Values that end up in the sbatch script: a newline would start a new `#SBATCH` option or
    shell command of the user's choosing, so none may hold control characters."""
    p: List[str] = []
    s = cfg.slurm
    for key, value, _ in _fields(s, "slurm."):
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, str) and _control(item):
                where = f"{key}[{i}]" if isinstance(value, list) else key
                p.append(f"{where}: contains {_control(item)}; a value written into the sbatch script must "
                         "be one line without control characters")
    for key, value in s.additional.items():
        if not _SBATCH_OPTION.match(key):
            p.append(f"slurm.additional: {key!r} is not an sbatch option name (letters, digits, '-' or '_', "
                     "e.g. mail-type)")
        elif _control(str(value)):
            p.append(f"slurm.additional.{key}: contains {_control(str(value))}; valid: a one-line value")
    for key, value in s.env.items():
        if not _ENV_NAME.match(key):
            p.append(f"slurm.env: {key!r} is not an environment variable name (letters, digits, '_'; "
                     "not starting with a digit)")
        elif _control(str(value)):
            p.append(f"slurm.env.{key}: contains {_control(str(value))}; valid: a one-line value")
    return p


# ---------------------------------------------------------------------------------- the model folder
class ModelShape(NamedTuple):
    heads: int
    kv_heads: int
    layers: int
    vocab_size: int
    max_positions: int = 0  # max_position_embeddings; 0 when config.json does not say


def read_model_shape(path: str, field: str = "model.path") -> ModelShape:
    """The numbers of a Hugging Face config.json that constrain the parallel layout."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{field}: no such folder '{path}'")
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"{field}: '{path}' has no config.json (expected a Hugging Face model folder)")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}: cannot read '{file}': {e}") from None
    if "num_attention_heads" not in data and isinstance(data.get("text_config"), dict):
        data = data["text_config"]  # multimodal configs nest the language model's numbers
    missing = [k for k in ("num_attention_heads", "num_hidden_layers", "vocab_size") if k not in data]
    if missing:
        raise ConfigError(f"{field}: '{file}' has no {', '.join(missing)}")
    try:
        heads = int(data["num_attention_heads"])
        return ModelShape(heads, int(data.get("num_key_value_heads") or heads), int(data["num_hidden_layers"]),
                          int(data["vocab_size"]), int(data.get("max_position_embeddings") or 0))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{field}: '{file}' has a non-integer head, layer or vocabulary count ({e})") from None


def _model(cfg: JobConfig, path: str, field: str) -> List[str]:
    try:
        m = read_model_shape(path, field)
    except ConfigError as e:
        return e.problems
    par, rtp, p = cfg.parallel, cfg.rollout.tp, []
    src = f"({field} config.json)"
    for name, count in (("num_attention_heads", m.heads), ("num_key_value_heads", m.kv_heads)):
        if par.tp > 0 and count % par.tp:
            p.append(f"parallel.tp = {par.tp} does not divide the model's {name} = {count} {src}")
    # vLLM's rule: query heads split evenly; KV heads split evenly, or are replicated when rollout.tp
    # is a multiple of them.
    if rtp > 0 and (m.heads % rtp or (m.kv_heads % rtp if rtp <= m.kv_heads else rtp % m.kv_heads)):
        p.append(f"rollout.tp = {rtp} does not fit the model's num_attention_heads = {m.heads} / "
                 f"num_key_value_heads = {m.kv_heads} {src}: it must divide both, or be a multiple of the KV heads")
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if m.max_positions and seq > m.max_positions:
        p.append(f"data.max_prompt_length + data.max_response_length = {seq} exceeds the model's "
                 f"max_position_embeddings = {m.max_positions} {src}")
    stages = par.pp * (par.vpp or 1)
    if stages > 0 and m.layers % stages:
        what = "parallel.pp" if par.vpp is None else f"parallel.pp * parallel.vpp = {par.pp} * {par.vpp}"
        p.append(f"{what} = {stages} does not divide the model's num_hidden_layers = {m.layers} {src}")
    return p


def _models(cfg: JobConfig) -> List[str]:
    if not cfg.model.path:
        return []
    p = _model(cfg, cfg.model.path, "model.path")
    tok = cfg.model.tokenizer_path
    if tok and tok != cfg.model.path and not Path(tok).is_dir():
        p.append(f"model.tokenizer_path: no such folder '{tok}'")
    if critic_enabled(cfg) and cfg.critic.model_path and cfg.critic.model_path != cfg.model.path:
        p += _model(cfg, cfg.critic.model_path, "critic.model_path")
    return p


# ---------------------------------------------------------------------------------- entry point
def validate(cfg: JobConfig, check_model: bool = True) -> None:
    """Raise one ConfigError listing every semantic problem; `check_model` reads model.path."""
    if not isinstance(cfg, JobConfig):
        raise ConfigError(f"validate() needs a JobConfig (from load_config), got {type(cfg).__name__}")
    from verl_hpc.config.loader import to_container
    from verl_hpc.config.structure import check_value

    # A config built or edited in Python has not been through the loader's type checks.
    check_value(to_container(cfg), JobConfig, (), lambda path: "the config object", mode="exact")
    problems = check_choices(cfg)
    if not problems:  # ranges and layout compare values whose names must be valid first
        problems = _ranges(cfg) + _layout(cfg) + _job(cfg) + _sbatch_text(cfg)
        if cfg.trainer.job == "rl":
            problems += _algorithm(cfg)
        if check_model:
            problems += _models(cfg)
    raise_if_any(problems)
