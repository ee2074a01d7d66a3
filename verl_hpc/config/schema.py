"""The typed schema of a verl_hpc job: one small dataclass per section of the YAML.

Defaults describe a tiny CPU run (2 local gloo ranks, float32), so that `load_config(None)` is
already a working smoke configuration. Field names are a contract with the rest of the package and
with the YAML files in configs/; `configs/base.yaml` lists every field with its default.

Fields with a fixed set of valid values carry it as `choices` metadata (checked by
`validate.check_choices`); fields whose valid names are defined by the algorithm vocabulary point at
a tuple of `verl_hpc.config.recipes` instead (`choices_from`), so that the names live in one place.
Fields documented as "auto" (None, "" or 0) are filled in by `resolve_auto` when a config is loaded.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

# typing.List/Dict rather than list[...]: OmegaConf's structured configs read these reliably.


def choice(default, *values):
    return field(default=default, metadata={"choices": values})


def choice_from(default, tuple_name: str):
    """Valid values are `getattr(verl_hpc.config.recipes, tuple_name)`."""
    return field(default=default, metadata={"choices_from": tuple_name})


def default_list(*items):
    return field(default_factory=lambda: list(items))


@dataclass
class ModelConfig:
    path: str = ""  # Hugging Face model folder
    tokenizer_path: str = ""  # auto: model.path
    dtype: str = choice("float32", "float32", "bfloat16", "float16")
    trust_remote_code: bool = False
    fp8: bool = False  # Transformer Engine FP8; GPU only


@dataclass
class DataConfig:
    train_files: List[str] = default_list()
    val_files: List[str] = default_list()
    prompt_key: str = "prompt"
    max_prompt_length: int = 256  # tokens
    max_response_length: int = 128  # tokens
    train_batch_size: int = 8  # prompts per step
    val_batch_size: int = 64
    shuffle: bool = True
    seed: int = 1
    overlong_prompts: str = choice("drop", "drop", "error")
    mixture: Dict[str, float] = field(default_factory=dict)  # data_source -> sampling weight
    wrap_plain_text: bool = True  # plain-text prompts go through the tokenizer's chat template
    sft_files: List[str] = default_list()  # trainer.job=sft: rows with prompt and response columns
    response_key: str = "response"  # SFT: column holding the target response


@dataclass
class KLControlConfig:
    type: str = choice("fixed", "fixed", "adaptive")
    kl_coef: float = 0.001
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only


@dataclass
class OverlongBufferConfig:
    """DAPO's soft length penalty over the last `len` tokens before max_response_length."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    recipe: Optional[str] = choice_from(None, "RECIPE_NAMES")
    adv_estimator: str = choice_from("grpo", "ADV_ESTIMATORS")
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = choice_from("k1", "KL_ESTIMATORS")
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: bool = False  # DAPO dynamic sampling: drop groups whose rewards are all equal
    max_num_gen_batches: int = 4  # with filter_groups: generation rounds per step at most
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: List[float] = default_list(0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0  # max grad norm; 0 = no clipping
    warmup_steps: int = 0
    lr_decay_style: str = choice("constant", "constant", "linear", "cosine")
    min_lr: float = 0.0


@dataclass
class ActorConfig:
    policy_loss: str = choice_from("vanilla", "POLICY_LOSSES")
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages
    loss_agg_mode: str = choice_from("token-mean", "LOSS_AGG_MODES")
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = choice_from("k3", "KL_ESTIMATORS")
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 8  # prompts per optimizer step
    micro_batch_size: int = 4  # sequences per forward; used when max_tokens_per_microbatch is 0
    max_tokens_per_microbatch: int = 0  # dynamic batching by token budget; 0 = off
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # auto: on iff algorithm.adv_estimator == "gae"
    model_path: str = ""  # auto: model.path
    cliprange_value: float = 0.5
    loss_agg_mode: str = choice_from("token-mean", "LOSS_AGG_MODES")
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 8
    micro_batch_size: int = 4
    max_tokens_per_microbatch: int = 0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass
class RefConfig:
    enable: Optional[bool] = None  # auto: on iff a KL term is used (in reward or as a loss)


@dataclass
class RolloutConfig:
    engine: str = choice("vllm", "vllm", "hf")
    n: int = 1  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_tokens: int = 0  # auto: data.max_response_length
    stop: List[str] = default_list()
    seed: int = 0
    tp: int = 1  # inference tensor parallel (independent of parallel.tp)
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int = 0  # CPU KV cache size; 0 = auto
    enforce_eager: bool = True
    sleep_between_phases: bool = False  # vLLM sleep mode (GPU only; a logged no-op elsewhere)
    prompt_overflow: str = choice("truncate", "truncate", "reject")
    bucket_mb: int = 512  # resharding bucket size
    val_temperature: float = 0.0


@dataclass
class RewardModelConfig:
    enable: bool = False
    path: str = ""


@dataclass
class RewardConfig:
    allow_custom_code: bool = False  # custom_function runs user code: an explicit opt-in
    custom_function: str = ""  # "package.module:function"
    on_error: str = choice("zero", "zero", "raise")
    gsm8k_method: str = choice("strict", "strict", "flexible")  # answer extraction for gsm8k rows
    timeout_s: float = 60.0  # per reward call (worker thread); past it the sample follows on_error; 0 = none
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass
class SmokeConfig:
    """The distributed smoke job; fail_rank/fail_at_step make one rank fail on purpose (tests)."""

    steps: int = 3
    step_seconds: float = 0.2
    fail_rank: int = -1
    fail_at_step: int = -1
    # exit: the rank dies at once (like a crash); hang: it stops answering collectives (like a
    # wedged GPU or a stuck file system), which only trainer.collective_timeout_s can catch
    fail_mode: str = choice("exit", "exit", "hang")


@dataclass
class TrainerConfig:
    job: str = choice("rl", "rl", "sft", "smoke")  # which program the ranks run
    total_steps: int = 10
    project_name: str = "verl_hpc"
    experiment_name: str = "run"
    output_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    val_every: int = 0  # steps; 0 = no validation
    seed: int = 1
    resume: str = "auto"  # auto | never | path of a checkpoint
    max_nonfinite_in_a_row: int = 3  # steps with a non-finite loss tolerated before failing
    sft_epochs: int = 1  # trainer.job=sft: passes over data.sft_files (total_steps caps the steps)
    hf_output_dir: str = ""  # trainer.job=sft: auto: <output_dir>/hf (the HF folder RL starts from)
    inject_nan_at_steps: List[int] = default_list()  # tests: RL steps whose loss is made NaN
    collective_timeout_s: int = 600  # a dead rank fails the job instead of hanging it
    stage_timeout_s: int = 1800  # a rank this long in one stage outside collectives fails the job; 0 = off
    smoke: SmokeConfig = field(default_factory=SmokeConfig)


@dataclass
class CheckpointConfig:
    dir: str = ""  # auto: <trainer.output_dir>/checkpoints
    save_every: int = 0  # steps; 0 = only on preemption and at the end
    keep_last: int = 3  # 0 = keep all
    async_save: bool = False


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule)
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    backend: str = choice("auto", "auto", "nccl", "gloo")  # auto: nccl with GPUs, else gloo


@dataclass
class ContainerConfig:
    runtime: str = choice("none", "none", "apptainer", "pyxis")
    image: str = ""
    mounts: List[str] = default_list()
    extra_args: List[str] = default_list()


@dataclass
class SlurmConfig:
    nodes: int = 1
    tasks_per_node: int = 2  # ranks per node; one per GPU on GPU clusters
    gpus_per_node: int = 0  # 0 = CPU job
    cpus_per_task: int = 1
    mem_gb: int = 0  # 0 = not requested
    time_min: int = 60
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    exclusive: bool = False
    job_name: str = "verl_hpc"
    log_dir: str = "${trainer.output_dir}/slurm/%j"  # submitit logs, next to the run; %j = job id
    signal_delay_s: int = 120  # the warning signal comes this long before the time limit
    requeue: bool = True
    container: ContainerConfig = field(default_factory=ContainerConfig)
    env: Dict[str, str] = field(default_factory=dict)  # added to / overriding the job environment
    setup: List[str] = default_list()  # shell lines run before srun (module load ...)
    additional: Dict[str, str] = field(default_factory=dict)  # extra #SBATCH options


@dataclass
class TrackingConfig:
    backends: List[str] = field(
        default_factory=lambda: ["console", "jsonl"],
        metadata={"choices": ("console", "jsonl", "tensorboard", "wandb", "mlflow", "prometheus")},
    )
    log_every: int = 1
    prometheus_port: int = 0  # needed when "prometheus" is a backend
    plots: bool = True  # PNG plots of the run's curves at the end
    console_metrics: List[str] = default_list()  # extra metric keys for the console table
    wandb_mode: str = choice("offline", "offline", "online", "disabled")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def world_size(self) -> int:
        return self.slurm.nodes * self.slurm.tasks_per_node

    @property
    def dp(self) -> int:
        """Data-parallel size of the training layout (validate() checks that it divides evenly)."""
        return self.world_size // max(1, self.parallel.tp * self.parallel.pp)

    @classmethod
    def from_container(cls, data: dict) -> "JobConfig":
        from verl_hpc.config.loader import from_container

        return from_container(data)


GROUP_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline", "gpg")
"""Estimators whose baseline is the other responses to the same prompt: they need rollout.n >= 2."""


def critic_enabled(cfg: JobConfig) -> bool:
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae"


def ref_enabled(cfg: JobConfig) -> bool:
    if cfg.ref.enable is not None:
        return cfg.ref.enable
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


def resolve_auto(cfg: JobConfig) -> JobConfig:
    """Fill the "auto" fields so that code downstream reads concrete values. Idempotent."""
    cfg.model.tokenizer_path = cfg.model.tokenizer_path or cfg.model.path
    cfg.critic.model_path = cfg.critic.model_path or cfg.model.path
    cfg.critic.enable = critic_enabled(cfg)
    cfg.ref.enable = ref_enabled(cfg)
    cfg.rollout.max_tokens = cfg.rollout.max_tokens or cfg.data.max_response_length
    cfg.checkpoint.dir = cfg.checkpoint.dir or f"{cfg.trainer.output_dir}/checkpoints"
    cfg.trainer.hf_output_dir = cfg.trainer.hf_output_dir or f"{cfg.trainer.output_dir}/hf"
    return cfg
