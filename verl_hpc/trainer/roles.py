"""Who takes part in a run: the tokenizer, the rollout engine and the engine roles, from config.

    roles = build_roles(cfg, ctx)
    roles.actor, roles.ref, roles.critic, roles.reward_model, roles.prm, roles.teacher, roles.rollout, roles.tokenizer

Each component below the trainer is built from its own sections (docs/architecture.md): the
functions here read the job config and hand each builder the sections and values it needs
(`rollout_options`, `episode_options`, `engine_options`; `build_engine` and `build_reference`
give the engine roles).

Only what the algorithm needs is built: the reference policy iff a KL term or the implicit PRM
uses it (`ref.enable`, auto), the critic iff the estimator needs values (`critic.enable`, auto:
gae), the reward model iff `reward.reward_model.enable`, PRIME's implicit PRM iff `prm.enable`
(auto: the prime estimator), the distillation teacher iff `teacher.enable`. Building is collective: every rank calls this.

Order: multi_turn's chat template, tools and environment first (verl_hpc/rollout/episodes/build.py): a job
whose tools cannot load fails in seconds, before any engine, and with no vLLM engine whose exit
path could print after the `error:` line. Then the rollout engine, then put to sleep, then the
Megatron engines. On GPU vLLM refuses
to start unless the free memory is at least `rollout.gpu_memory_utilization` x the GPU's total
(its start-up check counts memory other libraries hold as used), so it must start before the
training engines take theirs; with `rollout.sleep_between_phases` its sleep then hands its memory
to them. The trainer wakes it and loads the actor's weights before the first generate. Megatron's
and vLLM's process groups coexist in either order (both are created collectively, alike on every
rank).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.options import EngineOptions
from verl_hpc.config.sections.fsdp import choose_engine
from verl_hpc.engines.megatron.roles import build_role
from verl_hpc.engines.roles import Reference, wrap_role
from verl_hpc.rollout.speculative import stats as spec_stats
from verl_hpc.runtime import device as devices

if TYPE_CHECKING:
    from verl_hpc.rollout.episodes.build import EpisodeOptions
    from verl_hpc.rollout.engine_config import RolloutOptions

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Roles:
    tokenizer: Any
    actor: Any
    rollout: Any
    ref: Optional[Any] = None
    critic: Optional[Any] = None
    reward_model: Optional[Any] = None
    prm: Optional[Any] = None  # PRIME's implicit process reward model (trained online)
    teacher: Optional[Any] = None  # on-policy distillation's frozen teacher (teacher.enable)
    episodes: Optional[Any] = None  # multi_turn: the EpisodeRunner over `rollout` (verl_hpc/rollout/episodes/runner.py)
    agents: Optional[Any] = None  # agent.enable: the AgentRunner over `rollout` (verl_hpc/rollout/agents/)
    # every generation's result is handed to this before anyone uses it: the trainer sets the
    # weight step's check (LoRA: the adapter version it used, resharding/adapter_sync.py)
    verify: Callable[[Any], None] = lambda result: None

    def generate(self, prompts, spec):
        """The rollout of a PromptBatch: episodes under multi_turn, else one response per sample.
        With rollout.speculative on, the result carries the call's acceptance counts, job-wide."""
        def run():
            if self.agents is not None:
                return self.agents.generate(prompts, spec)
            if self.episodes is None:
                return self.rollout.generate(prompts.prompt_ids, spec, media=prompts.media or None)
            return self.episodes.generate(prompts.prompt_ids, spec, rows=prompts.extras,
                                          offered=[x.get("tools") for x in prompts.extras])

        result = spec_stats.measured(self.rollout, run)
        self.verify(result)
        return result

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

    def trained_engines(self) -> dict:
        """The engines a checkpoint holds, by role name: the actor, (PPO) the critic and (PRIME) the
        implicit PRM when it trains. The reference, a reward model, the distillation teacher and a
        frozen PRM (prm.update = none, no optimizer) are not trained and are rebuilt from their folders."""
        out = {"actor": self.actor.engine}
        if self.critic is not None:
            out["critic"] = self.critic.engine
        if self.prm is not None and getattr(self.prm.engine, "optimizer", None) is not None:
            out["prm"] = self.prm.engine
        return out

    def names(self) -> list:
        return [n for n in ("actor", "ref", "critic", "reward_model", "prm", "teacher") if getattr(self, n) is not None]


def pad_token_id(tokenizer) -> int:
    """The id padded rows hold, for every program: the tokenizer's pad token, else its EOS, else 0
    (never trained on: the masks leave padding out)."""
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    return int(pad if pad is not None else 0)


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer_path,
                                         trust_remote_code=cfg.model.trust_remote_code)


def engine_options(cfg, role: str, *, fp8: Optional[bool] = None, loss_norm_len: Optional[float] = None,
                   total_steps: Optional[int] = None) -> EngineOptions:
    """The engine options of `role` (actor, critic, ref, reward, prm, teacher) of a loaded job config. fp8:
    None = model.fp8; total_steps: None = trainer.total_steps (sft/dpo pass the steps the data gives)."""
    return EngineOptions.for_role(
        role, model=cfg.model, parallel=cfg.parallel, actor=cfg.actor, ref=cfg.ref, critic=cfg.critic,
        prm=cfg.prm, reward=cfg.reward, lora=cfg.lora, temperature=cfg.rollout.temperature,
        lora_seed=cfg.trainer.seed, total_steps=total_steps or cfg.trainer.total_steps, fp8=fp8,
        loss_norm_len=loss_norm_len, fsdp=cfg.fsdp, vision=cfg.vision, teacher=cfg.teacher)


# the field that names each role's model folder (the engine choice and its errors name it)
MODEL_FIELDS = {"actor": "model.path", "ref": "model.path", "critic": "critic.model_path",
                "reward": "reward.reward_model.path", "prm": "prm.model_path", "teacher": "teacher.model_path"}


def build_engine(role: str, cfg, ctx=None, *, model_path: Optional[str] = None, field: Optional[str] = None,
                 **kwargs):
    """The role object for `role` in {actor, critic, ref, reward, prm, teacher} on the engine that
    parallel.engine picks for the role's model folder (verl_hpc.config.sections.fsdp.choose_engine;
    the teacher: teacher.engine, by default the actor's): Megatron's engines/megatron/roles.py
    build_role, or the FSDP engine; collective: call on every rank. model_path, field: another folder
    than the role's field names, and the field that names it in errors (a teacher of
    teacher.by_data_source); kwargs: fp8, loss_norm_len, total_steps (see engine_options)."""
    options = engine_options(cfg, role, **kwargs)
    if model_path:
        options = dataclasses.replace(options, model_path=model_path)
    field = field or MODEL_FIELDS[role]
    engine = (cfg.teacher.engine_for(cfg) if role == "teacher" else
              choose_engine(cfg.parallel.engine, options.model_path, cfg.parallel, field))
    options = dataclasses.replace(options, engine=engine)
    role_cfg = {"actor": cfg.actor, "critic": cfg.critic, "prm": cfg.prm}.get(role)
    if options.engine == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        return wrap_role(role, FsdpEngine(options, field), role_cfg, n=cfg.rollout.n)
    return build_role(role, options, parallel=cfg.parallel, seed=cfg.trainer.seed,
                      timeout_s=cfg.trainer.collective_timeout_s, role_cfg=role_cfg, n=cfg.rollout.n)


def build_reference(cfg, ctx, actor, build=None) -> Reference:
    """The reference policy: under LoRA the actor's base (adapters off, no memory of its own),
    else a frozen engine of its own (`build`, default build_engine, called as build("ref", cfg, ctx))."""
    if cfg.lora.enabled:
        return Reference(actor.engine)
    return (build or build_engine)("ref", cfg, ctx)


def build_teachers(cfg, ctx=None):
    """On-policy distillation's teachers (verl_hpc/trainer/stages/teacher_stage.py Teachers): one
    frozen engine per distinct folder of teacher.model_path and teacher.by_data_source, each row
    routed to its data_source's teacher. Collective: every rank builds them in the same order."""
    from verl_hpc.trainer.stages.teacher_stage import Teachers

    fields = {}
    for field, folder in cfg.teacher.folders().items():
        fields.setdefault(folder, field)  # a folder named twice is built once, under its first field
    return Teachers({f: build_engine("teacher", cfg, ctx, model_path=f, field=field) for f, field in fields.items()},
                    cfg.teacher)


def build_reward_model(cfg, ctx, tokenizer, rollout=None):
    """reward.reward_model: a scorer (kind = scorer: the engine's frozen reward role, a forward on
    the training ranks) or a generative judge (kind = judge: verl_hpc/rewards/judge.py on its own
    engine, a second in-process vLLM or HF generate), asleep between the steps' scoring."""
    rm = cfg.reward.reward_model
    if rm.kind == "scorer":
        from verl_hpc.config.rm_folder import scorer_head_problem

        problem = scorer_head_problem(rm.path)  # again here: the engines would seed a random head
        if problem:
            raise ConfigError(problem)
        return build_engine("reward", cfg, ctx)
    from verl_hpc.config.hf_model import language_model_config, read_hf_config
    from verl_hpc.rewards.judge import Judge
    from verl_hpc.rollout.factory import build_judge_engine

    positions = language_model_config(read_hf_config(rm.path, "reward.reward_model.path")).get(
        "max_position_embeddings") or 4096
    # the template around the prompt and the response, and the verdict's tokens
    want = cfg.data.max_prompt_length + cfg.rollout.max_tokens + 512 + rm.judge.max_tokens
    from verl_hpc.rollout import VLLMRollout

    def build():  # again after a failure of the engine (Judge._rebuilt)
        return build_judge_engine(cfg.reward, cfg.model.trust_remote_code, max_model_len=min(want, positions),
                                  seed=cfg.trainer.seed, beside_vllm_rollout=isinstance(rollout, VLLMRollout))

    judge = Judge(build(), rm.judge, on_error=cfg.reward.on_error, tokenizer=tokenizer,
                  rule_correct_at=cfg.reward.correct_at, rebuild=build,
                  max_restarts=cfg.rollout.max_engine_restarts)
    judge.sleep()
    return judge


def build_roles(cfg, ctx, *, with_rollout: bool = True) -> Roles:
    """The caller owns the returned rollout engine, episode runner and judge and closes them (`with
    roles.rollout:`, `with roles.episodes:`, `with roles.reward_model:` for a judge); if a role
    built after them fails, they are closed here before the error goes on."""
    tokenizer = load_tokenizer(cfg)
    rollout, parts, episodes = None, None, None
    with contextlib.ExitStack() as on_error:
        if with_rollout and cfg.multi_turn.enable:  # first: what fails here fails before any engine loads
            from verl_hpc.rollout.episodes.build import episode_parts

            parts = episode_parts(episode_options(cfg), ctx, tokenizer)
            on_error.callback(parts[1].close)  # its tool workers and sandbox
        if with_rollout:
            from verl_hpc.rollout import build_rollout

            rollout = on_error.enter_context(build_rollout(rollout_options(cfg), ctx))
            rollout.sleep()  # rollout.sleep_between_phases: its memory goes to the engines built next
        actor = build_engine("actor", cfg, ctx)
        ref = build_reference(cfg, ctx, actor, build_engine) if cfg.ref.enable else None
        critic = build_engine("critic", cfg, ctx) if cfg.critic.enable else None
        rm = build_reward_model(cfg, ctx, tokenizer, rollout) if cfg.reward.reward_model.enable else None
        if hasattr(rm, "close"):  # a judge's own engine: closed if a role built after it fails
            on_error.callback(rm.close)
        prm = build_engine("prm", cfg, ctx) if cfg.trainer.job == "rl" and cfg.prm.enable else None
        teacher = build_teachers(cfg, ctx) if cfg.trainer.job == "rl" and cfg.teacher.enable else None
        if parts is not None:
            from verl_hpc.rollout.episodes.build import build_episode_runner

            episodes = build_episode_runner(episode_options(cfg), ctx, rollout, parts)
        agents = build_agents(cfg, ctx, rollout, tokenizer) if with_rollout and cfg.agent.enable else None
        on_error.pop_all()  # all built: the engine (and the episode runner) stay open for the caller
    roles = Roles(tokenizer, actor, rollout, ref, critic, rm, prm=prm, teacher=teacher, episodes=episodes,
                  agents=agents)
    if ctx.rank == 0:
        lora = cfg.lora
        log.info("roles: %s; rollout: %s%s", ", ".join(roles.names()), cfg.rollout.engine,
                 f"; LoRA rank {lora.rank} on {', '.join(lora.target_modules)} (the base frozen"
                 f"{'; ref = the base, adapters off' if roles.ref is not None else ''})" if lora.enabled else "")
    return roles


def lora_slot_rank(cfg) -> int:
    """The adapter rank vLLM's LoRA slot must take (0: none): lora.rank when the job syncs the
    adapter only (lora.sync, resolved for this rank's machine), else 0 (merged weights need no slot)."""
    return cfg.lora.rank if cfg.lora.syncs_adapter(cfg, "vllm", gpu=devices.has_gpu()) else 0


def rollout_options(cfg) -> RolloutOptions:
    """What the rollout engine is built from (verl_hpc/rollout/engine_config.py)."""
    from verl_hpc.rollout.engine_config import RolloutOptions

    r = cfg.rollout
    return RolloutOptions(rollout=r, model=cfg.model, max_prompt_length=cfg.data.max_prompt_length,
                          window=r.window(cfg), max_num_seqs=r.max_num_seqs(cfg),
                          collective_timeout_s=cfg.trainer.collective_timeout_s, split=cfg.placement.split,
                          lora_rank=lora_slot_rank(cfg), episodes=cfg.multi_turn.enable,
                          decode_tokens=r.decode_tokens(cfg), compile_cache=compile_cache(cfg))


def compile_cache(cfg) -> str:
    """The job's folder for vLLM's compilation (rollout.enforce_eager false): beside its checkpoints,
    so that a requeued or resumed job loads what its first start compiled (rollout/vllm/compile_cache.py)."""
    return f"{cfg.trainer.output_dir}/cache/compile"


def build_agents(cfg, ctx, rollout, tokenizer):
    """agent.enable: the AgentRunner (its endpoint started) over this rank's rollout engine."""
    from verl_hpc.rollout.agents import AgentOptions, AgentRunner

    return AgentRunner(rollout, tokenizer, AgentOptions(agent=cfg.agent, on_error=cfg.reward.on_error,
                                                        allow_custom_code=cfg.safety.allow_custom_code,
                                                        max_tokens=cfg.rollout.max_tokens, sandbox=cfg.sandbox), ctx)


def episode_options(cfg) -> EpisodeOptions:
    """What multi_turn's episodes are built from (verl_hpc/rollout/episodes/build.py)."""
    from verl_hpc.rollout.episodes.build import EpisodeOptions

    return EpisodeOptions(multi_turn=cfg.multi_turn, sandbox=cfg.sandbox,
                          allow_custom_code=cfg.safety.allow_custom_code, on_error=cfg.reward.on_error,
                          cpus_per_task=cfg.slurm.cpus_per_task, budget=cfg.data.max_response_length)
