"""The typed schema of a verl_hpc job: the sections of `verl_hpc/config/sections/` joined.

Defaults describe a tiny CPU run (2 local gloo ranks, float32), so that `load_config(None)` is
already a working smoke configuration. Each section owns its fields (default, help, choices or
range), its cross-field checks and its auto values; `configs/base.yaml` is generated from these
declarations (`python -m verl_hpc.config --write-base configs/base.yaml`) and a test keeps it equal.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple

from verl_hpc.config.fields import section, sections, valid_choices
from verl_hpc.config.layout import Layout
from verl_hpc.config.sections.algorithm import (GROUP_ESTIMATORS, AccuracyFilterConfig, AlgorithmConfig,
                                                KLControlConfig, OverlongBufferConfig, PreferenceConfig,
                                                RolloutCorrectionConfig)
from verl_hpc.config.sections.cluster import ContainerConfig, ParallelConfig, SlurmConfig
from verl_hpc.config.sections.data import DataConfig
from verl_hpc.config.sections.fsdp import FsdpConfig
from verl_hpc.config.sections.lora import LoraConfig
from verl_hpc.config.sections.model import ModelConfig
from verl_hpc.config.sections.agent import AgentConfig
from verl_hpc.config.sections.multi_turn import MultiTurnConfig, SandboxConfig
from verl_hpc.config.sections.placement import AsyncTrainingConfig, PlacementConfig
from verl_hpc.config.sections.prm import PrmConfig
from verl_hpc.config.sections.reward import RewardConfig, RewardModelConfig
from verl_hpc.config.sections.roles import ActorConfig, CriticConfig, OptimConfig, RefConfig
from verl_hpc.config.sections.rollout import ReshardingConfig, RolloutConfig
from verl_hpc.config.sections.safety import SafetyConfig
from verl_hpc.config.sections.teacher import TeacherConfig
from verl_hpc.config.sections.tracking import TrackingConfig
from verl_hpc.config.sections.trainer import CheckpointConfig, SmokeConfig, TrainerConfig
from verl_hpc.config.sections.vision import VisionConfig


@dataclass
class JobConfig:
    model: ModelConfig = section(ModelConfig, "the Hugging Face model the job trains and serves")
    data: DataConfig = section(DataConfig, "prompt files, lengths, batch sizes")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantage estimator, reward KL, DAPO filters")
    actor: ActorConfig = section(ActorConfig, "the policy: loss, batching, optimizer")
    critic: CriticConfig = section(CriticConfig, "the value model (PPO with GAE)")
    ref: RefConfig = section(RefConfig, "the frozen reference policy (KL terms, the PRM's log-ratio)")
    prm: PrmConfig = section(PrmConfig, "PRIME's implicit process reward model, trained online on the rollouts")
    teacher: TeacherConfig = section(TeacherConfig, "on-policy distillation: a frozen teacher scores the student's "
                                                    "sampled tokens (reverse KL as a reward or a loss)")
    lora: LoraConfig = section(LoraConfig, "low-rank adapters on the actor instead of full-parameter training")
    rollout: RolloutConfig = section(RolloutConfig, "the inference engine that generates responses")
    resharding: ReshardingConfig = section(ReshardingConfig, "the weight step from the trainer to the rollout engine")
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "episodes of model and tool turns (agentic rollout)")
    agent: AgentConfig = section(AgentConfig, "agent programs as rollouts, over an OpenAI-compatible endpoint")
    sandbox: SandboxConfig = section(SandboxConfig, "the process that runs model-written code (the python tool)")
    reward: RewardConfig = section(RewardConfig, "how responses are scored")
    trainer: TrainerConfig = section(TrainerConfig, "which program the ranks run, and for how long")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "HDF5 checkpoints")
    parallel: ParallelConfig = section(ParallelConfig, "training layout; data parallel = training ranks / (tp * cp * pp)")
    vision: VisionConfig = section(VisionConfig, "images in the prompts (vision-language models): where rows "
                                                 "keep them, their limits, whether the vision tower trains")
    fsdp: FsdpConfig = section(FsdpConfig, "the FSDP2 engine (parallel.engine = fsdp | auto): sharding, "
                                           "precision, recompute, offload, compile")
    placement: PlacementConfig = section(PlacementConfig, "colocated (every rank does everything) or split "
                                                          "(rollout ranks apart from training ranks)")
    async_training: AsyncTrainingConfig = section(AsyncTrainingConfig, "split placement: how far rollout may "
                                                                       "run ahead of training")
    slurm: SlurmConfig = section(SlurmConfig, "the allocation and how ranks start")
    tracking: TrackingConfig = section(TrackingConfig, "where metrics go")
    safety: SafetyConfig = section(SafetyConfig, "risky features, all off by default (a banner says when one is on)")

    @property
    def world_size(self) -> int:
        """Every rank of the one srun step; a heterogeneous split job adds its rollout nodes."""
        return self.slurm.world_size + self.placement.added_nodes * self.slurm.tasks_per_node

    @property
    def world_words(self) -> str:
        s = self.slurm
        if not self.placement.added_nodes:
            return s.world_words
        return (f"the world size {self.world_size} ((placement.rollout_nodes {self.placement.added_nodes} + "
                f"slurm.nodes {s.nodes}) * slurm.tasks_per_node {s.tasks_per_node})")

    @property
    def train_world_size(self) -> int:
        """Ranks that hold the Megatron roles (all of them unless placement.mode = split)."""
        return self.placement.train_ranks(self.world_size)

    @property
    def rollout_world_size(self) -> int:
        """Ranks that hold a vLLM engine (all of them unless placement.mode = split)."""
        return self.placement.rollout_world(self.world_size)

    @property
    def layout(self) -> Layout:
        p = self.parallel
        words = self.world_words
        if self.placement.split:
            words = (f"the {self.train_world_size} training ranks ({self.world_words} - "
                     f"placement.rollout_ranks {self.placement.rollout_ranks})")
        return Layout(self.train_world_size, p.tp, p.pp, p.cp, vpp=p.vpp, world_words=words, ep=p.ep, etp=p.etp,
                      sp=self.fsdp.sp)

    @property
    def sequences_per_example(self) -> int:
        """Sequences a step trains on per example of data.train_batch_size: rollout.n responses
        per prompt (rl); two for a preference pair (dpo: chosen and rejected, or KTO's completion
        and its mismatched pair); one response for sft."""
        return {"rl": self.rollout.n, "dpo": 2}.get(self.trainer.job, 1)

    @property
    def dp(self) -> int:
        """Data-parallel size of the training layout (0 when tp * cp * pp does not divide the world)."""
        return self.layout.dp

    def resolve(self) -> "JobConfig":
        """Fill every section's "auto" fields so that code downstream reads concrete values. Idempotent."""
        for _, sec in sections(self):
            sec.resolve(self)
        return self


__all__ = [
    "AccuracyFilterConfig", "ActorConfig", "AgentConfig", "AlgorithmConfig", "AsyncTrainingConfig", "CheckpointConfig", "FsdpConfig", "ContainerConfig", "CriticConfig", "DataConfig",
    "GROUP_ESTIMATORS", "JobConfig", "KLControlConfig", "ModelConfig", "OptimConfig", "OverlongBufferConfig",
    "ParallelConfig", "PlacementConfig", "PreferenceConfig", "PrmConfig", "RefConfig", "RolloutCorrectionConfig", "ReshardingConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig",
    "SafetyConfig", "SlurmConfig", "SmokeConfig", "TeacherConfig", "TrackingConfig", "TrainerConfig", "choices_of", "default_of",
]


def default_of(key: str):
    """The declared default of a dotted field ('rollout.prompt_overflow'), for keyword defaults of
    components that can also be built without a config (tests, benchmarks): the value stays
    written once, in its section."""
    value = _DEFAULTS
    for part in key.split("."):
        value = getattr(value, part)
    if isinstance(value, (list, dict)) or hasattr(value, "__dataclass_fields__"):
        raise TypeError(f"default_of({key!r}): only scalar defaults can be shared")
    return value


def choices_of(key: str) -> Tuple[str, ...]:
    """The declared valid names of a dotted field ('rollout.engine'), for components that check a
    value they may be handed without a config: the list stays written once, in its section."""
    *path, name = key.split(".")
    owner = _DEFAULTS
    for part in path:
        owner = getattr(owner, part)
    meta = next(f.metadata for f in dataclasses.fields(owner) if f.name == name)
    valid = valid_choices(meta)
    if not valid:
        raise TypeError(f"choices_of({key!r}): the field declares no choices")
    return valid


_DEFAULTS = JobConfig()
