"""Semantic checks of a loaded config: declared choices and ranges, each section's own rules, the
parallel layout, and the model folder's shape.

`validate` collects every problem it finds and raises them together (one line each), so that a
user fixes a config in one round. Each line names the fields involved and what would be valid.
The rules themselves live with the fields they constrain (verl_hpc/config/sections/) and, for
the layout, in verl_hpc/config/layout.py; this module only runs them in order.
"""
from __future__ import annotations

from typing import List

from verl_hpc.config.errors import ConfigError, raise_if_any
from verl_hpc.config.fields import choice_problems, range_problems, sections
from verl_hpc.config.hf_model import ModelShape, read_hf_config, read_model_shape
from verl_hpc.config.layout import rollout_tp_problems
from verl_hpc.config.schema import JobConfig
from verl_hpc.config.sections.fsdp import choose_engine, engine_layout_problems, sp_head_problems
from verl_hpc.config.sections.vision import vision_problems


def check_choices(cfg: JobConfig) -> List[str]:
    return choice_problems(cfg)


def _model(cfg: JobConfig, path: str, field: str) -> List[str]:
    try:
        m = read_model_shape(path, field)
        engine = choose_engine(cfg.parallel.engine, path, cfg.parallel, field)
    except ConfigError as e:
        return e.problems
    p = model_rule_problems(cfg, m, field)
    if cfg.parallel.engine == "auto":  # an explicit fsdp was checked with the fsdp section
        p += engine_layout_problems(engine, cfg)
    return p + vision_problems(cfg, read_hf_config(path, field), engine, field)


def model_rule_problems(cfg: JobConfig, m: ModelShape, field: str) -> List[str]:
    """The job's rules that depend on the model's shape (the layout's splits, the rollout's TP, the
    KV cache, what an MoE model needs, the sequence length): what `submit` checks, and what the
    memory planner checks on the shape it plans (config.json, or a known architecture's)."""
    p = cfg.layout.model_problems(m) + rollout_tp_problems(cfg.rollout.tp, m)
    if field == "model.path" and cfg.trainer.job == "rl":  # the rollout engine serves the policy
        p += cfg.rollout.kv_cache_problems(cfg, m)
    p += _moe_problems(cfg, m, field)
    p += sp_head_problems(cfg.fsdp.sp, m.heads, m.kv_heads)
    seq = cfg.data.max_sequence_length
    if m.max_positions and seq > m.max_positions:
        p.append(f"data.max_prompt_length + data.max_response_length = {seq} exceeds the model's "
                 f"max_position_embeddings = {m.max_positions} {m.source}")
    return p


def _moe_problems(cfg: JobConfig, m: ModelShape, field: str) -> List[str]:
    """What a mixture-of-experts model needs of the rest of the job."""
    if not m.experts:
        return cfg.model.dense_replay_problem(m.source) if field == "model.path" else []
    p = []
    par = cfg.parallel
    if par.tp > 1 and not par.sequence_parallel:
        p.append(f"{field} is a mixture-of-experts model {m.source} and parallel.tp = {par.tp}: Megatron's MoE "
                 "layer trains with tensor parallelism only under parallel.sequence_parallel=true (GPUs, "
                 "Transformer Engine); use parallel.ep (expert parallel) with parallel.tp=1 otherwise")
    if field == "model.path" and cfg.model.moe_routing_replay != "off" and m.router != "softmax":
        p.append(f"model.moe_routing_replay = {cfg.model.moe_routing_replay} with a {m.router}-routed model {m.source} "
                 "(the DeepSeek-V3 family) is not built: the route recorder and replay cover softmax routers "
                 "(Mixtral, Qwen2-MoE, Qwen3-MoE); set model.moe_routing_replay=off")
    if field == "model.path" and cfg.lora.enabled:
        p.append(f"lora.enabled with a mixture-of-experts model {m.source} is not supported: the adapters "
                 "cover dense layers only; train the full model (parallel.ep splits its experts)")
    return p


def _models(cfg: JobConfig) -> List[str]:
    if not cfg.model.path:
        return []
    p = _model(cfg, cfg.model.path, "model.path") + cfg.model.folder_problems()
    p += cfg.rollout.speculative.folder_problems(cfg)  # an MTP model's layers, a draft model's vocabulary
    critic = cfg.critic.model_path
    if cfg.critic.wanted(cfg) and critic and critic != cfg.model.path:
        p += _model(cfg, critic, "critic.model_path")
    prm = cfg.prm.model_path
    if cfg.trainer.job == "rl" and cfg.prm.wanted(cfg) and prm and prm != cfg.model.path:
        p += _model(cfg, prm, "prm.model_path")  # the PRM is built in the training layout too
    p += cfg.reward.reward_model.folder_problems(cfg)  # a scorer's head and tokenizer, a judge's tokens
    teacher = cfg.teacher
    if teacher.enable and cfg.trainer.job == "rl":
        folder = teacher.folder_problems(cfg)  # the folders and their tokenizers first: shapes mean little else
        p += folder
        for field, path in ({} if folder else teacher.folders()).items():
            if path != cfg.model.path:
                p += _model(cfg, path, field)  # in the training layout too
    return p


def validate(cfg: JobConfig, check_model: bool = True) -> None:
    """Raise one ConfigError listing every semantic problem; `check_model` reads model.path."""
    if not isinstance(cfg, JobConfig):
        raise ConfigError(f"validate() needs a JobConfig (from load_config), got {type(cfg).__name__}")
    from verl_hpc.config.loader import to_container
    from verl_hpc.config.structure import check_value

    # A config built or edited in Python has not been through the loader's type checks.
    check_value(to_container(cfg), JobConfig, (), lambda path: "the config object", mode="exact")
    problems = choice_problems(cfg)
    if not problems:  # ranges and rules compare values whose names must be valid first
        problems = range_problems(cfg)
        for _, sec in sections(cfg):
            problems += sec.check(cfg)
        if check_model:
            problems += _models(cfg)
    raise_if_any(problems)


__all__ = ["ModelShape", "check_choices", "model_rule_problems", "read_model_shape", "validate"]
