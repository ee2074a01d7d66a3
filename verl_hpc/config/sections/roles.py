"""`actor:`, `critic:`, `ref:` the trained and frozen roles, and the optimizer each trained role owns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from verl_hpc.config.fields import Section, opt, section
from verl_hpc.config.recipes import ROW_LOCAL_POLICY_LOSSES

MAX_LOSS_SCALE = 2.0**32  # fp16 dynamic loss scaling: Megatron's default start, the largest accepted


@dataclass
class OptimConfig(Section):
    lr: float = opt(1e-6, "peak learning rate", check=">=0")
    weight_decay: float = opt(0.0, "AdamW weight decay", check=">=0")
    betas: List[float] = opt([0.9, 0.999], "Adam betas")
    eps: float = opt(1e-8, "Adam epsilon")
    clip_grad: float = opt(1.0, "max gradient norm; 0 = no clipping", check=">=0")
    warmup_steps: int = opt(0, "linear warm-up steps", check=">=0")
    lr_decay_style: str = opt("constant", "after warm-up", choices=("constant", "linear", "cosine"))
    min_lr: float = opt(0.0, "floor of the decay", check=">=0")
    # fp16 only (model.dtype = float16; the FSDP engine: a float16 compute dtype): dynamic loss
    # scaling, the same rule in both engines (Megatron's DynamicGradScaler, torch's ShardedGradScaler):
    # an overflow skips the step and halves the scale, loss_scale_window clean steps double it
    initial_loss_scale: float = opt(65536.0, "fp16: the loss scale at the start, at most 2^32 (torch's "
                                             "GradScaler's 2^16; Megatron's own 2^32 costs ~16 skipped steps to "
                                             "come down)",
                                    check=">0")
    min_loss_scale: float = opt(1.0, "fp16: the scale never halves below this", check=">0")
    loss_scale_window: int = opt(1000, "fp16: optimizer steps without an overflow before the scale doubles",
                                 check=">0")

    def check(self, job) -> List[str]:
        role = next(name for name in ("actor", "critic", "prm") if getattr(job, name).optim is self)
        p = self.own_problems(f"{role}.optim")
        # The run's step count is at most trainer.total_steps (sft/dpo: fewer when the data runs
        # out first, which the scheduler builder still checks on the node)
        used = role == "actor" or (job.trainer.job == "rl" and getattr(job, role).wanted(job))
        if used and self.lr_decay_style != "constant" and self.warmup_steps >= job.trainer.total_steps:
            p.append(f"{role}.optim.warmup_steps = {self.warmup_steps} must be below trainer.total_steps = "
                     f"{job.trainer.total_steps} for lr_decay_style = {self.lr_decay_style}")
        return p

    def own_problems(self, key: str) -> List[str]:
        """The rules among this section's own fields, named under `key` (also checked by the
        engine's optimizer builder for a section made without the loader: tests, benchmarks)."""
        p = []
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            p.append(f"{key}.betas: must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0:
            p.append(f"{key}.eps: must be > 0, got {self.eps}")
        if self.min_lr > self.lr:
            p.append(f"{key}.min_lr = {self.min_lr} is above {key}.lr = {self.lr}")
        if self.initial_loss_scale > MAX_LOSS_SCALE:
            # an overflow halves the scale and skips the step: 1e300 skips ~1000 steps before one
            # trains (a shorter run ends with every step skipped, its loss and grad_norm null)
            p.append(f"{key}.initial_loss_scale = {self.initial_loss_scale:g}: valid (0, 2**32] (Megatron's own "
                     f"default, 2**32, is the largest start either engine takes; above it fp16 steps overflow "
                     f"and are skipped while the scale halves down)")
        elif self.min_loss_scale > self.initial_loss_scale:
            p.append(f"{key}.min_loss_scale = {self.min_loss_scale:g} is above {key}.initial_loss_scale = "
                     f"{self.initial_loss_scale:g}")
        return p


@dataclass
class TrainedRole(Section):
    """What the actor and the critic share: how a step's sequences become optimizer steps and
    micro batches, and the rules that keep every data-parallel rank's share equal."""

    name = ""
    ppo_epochs: int = opt(1, "passes over each step's batch", check=">0")
    ppo_mini_batch_size: int = opt(8, "prompts per optimizer step (x rollout.n sequences)", check=">0")
    micro_batch_size: int = opt(4, "sequences per forward/backward when max_tokens_per_microbatch is 0",
                                check=">0")
    max_tokens_per_microbatch: int = opt(0, "dynamic batching: token budget per micro batch and rank; a "
                                            "group that shares each sequence (fsdp.sp, parallel.cp ranks) "
                                            "takes that many times it; 0 = off", check=">=0")
    # host offload while the role is idle; results are unchanged (engines/offload.py)
    param_offload: bool = opt(False, "keep the weights in host memory while the role is idle")
    grad_offload: bool = opt(False, "drop the fp32 gradient buffers while idle (each update zeroes them)")
    optimizer_offload: bool = opt(False, "keep the optimizer states in host memory while idle")

    def batch_problems(self, job) -> List[str]:
        layout, d, n = job.layout, job.data, job.sequences_per_example
        mb, micro, budget = self.ppo_mini_batch_size, self.micro_batch_size, self.max_tokens_per_microbatch
        dp = layout.dp
        if job.trainer.job == "smoke" or not layout.tiles or min(mb, micro, d.train_batch_size, n) <= 0 or (d.train_batch_size * n) % dp:
            return []  # reported by the layout, the ranges or data.train_batch_size
        p, per_rank = [], mb * n // dp
        if d.train_batch_size % mb:
            p.append(f"{self.name}.ppo_mini_batch_size = {mb} does not divide data.train_batch_size = "
                     f"{d.train_batch_size}")
        elif (mb * n) % dp:
            p.append(f"{self.name}.ppo_mini_batch_size * rollout.n = {mb} * {n} = {mb * n} sequences per "
                     f"optimizer step is not divisible by {layout.dp_words}")
        elif budget == 0 and per_rank % micro:
            verb = "is more than" if micro > per_rank else "does not divide"
            p.append(f"{self.name}.micro_batch_size = {micro} {verb} the {per_rank} sequence(s) each rank "
                     f"gets per optimizer step ({self.name}.ppo_mini_batch_size * rollout.n / {dp} ranks)")
        shared = layout.sp * layout.cp  # the ranks that hold one sequence between them
        if 0 < budget * shared < d.max_sequence_length:
            group = f" x {shared} ranks sharing each sequence (fsdp.sp / parallel.cp)" if shared > 1 else ""
            p.append(f"{self.name}.max_tokens_per_microbatch = {budget}{group} is smaller than one full sequence "
                     f"(data.max_prompt_length + data.max_response_length = {d.max_sequence_length})")
        return p


@dataclass
class ActorConfig(TrainedRole):
    name = "actor"
    policy_loss: str = opt("vanilla", "the policy-gradient loss (vanilla = PPO clip; the names: docs/algorithms.md)",
                           choices_from="POLICY_LOSSES")
    clip_ratio_low: float = opt(0.2, "PPO clip below 1", check="[0, 1)")
    clip_ratio_high: float = opt(0.2, "PPO clip above 1; > clip_ratio_low = DAPO clip-higher")
    clip_ratio_c: float = opt(3.0, "dual-clip lower bound for negative advantages (> 1)")
    loss_agg_mode: str = opt("token-mean", "how token losses become one loss", choices_from="LOSS_AGG_MODES")
    entropy_coeff: float = opt(0.0, "entropy bonus")
    use_kl_loss: bool = opt(False, "KL to the reference policy as a loss term (GRPO style; needs ref)")
    kl_loss_coef: float = opt(0.001, "coefficient of the KL loss", check=">=0")
    kl_loss_type: str = opt("k3", "same names as algorithm.kl_penalty", choices_from="KL_ESTIMATORS")
    # policy_loss clip_cov / kl_cov (Cui et al. 2025, arXiv 2505.22617; verl's names and defaults)
    clip_cov_ratio: float = opt(0.0002, "clip_cov: share of valid tokens whose loss is zeroed", check="(0, 1]")
    clip_cov_lb: float = opt(1.0, "clip_cov: candidates have covariance in (lb, ub)")
    clip_cov_ub: float = opt(5.0, "clip_cov: upper bound of the covariance window")
    kl_cov_ratio: float = opt(0.0002, "kl_cov: share of valid tokens penalised", check="(0, 1]")
    ppo_kl_coef: float = opt(1.0, "kl_cov: coefficient of |logp - old_logp| on those tokens", check=">=0")
    # policy_loss sapo (arXiv 2511.20347; verl's names, the paper's values)
    tau_pos: float = opt(1.0, "sapo: temperature of the soft gate for positive advantages", check=">0")
    tau_neg: float = opt(1.05, "sapo: temperature for negative advantages (> tau_pos decays them faster)",
                         check=">0")
    # policy_loss dro (verl PR #7245; its example's value): dppo_tv / dppo_kl read clip_ratio_low/high as
    # their divergence bounds and clip_ratio_c as their importance-weight cap, as verl does
    dro_beta: float = opt(0.05, "dro: coefficient of the penalty beta/2 (logp - old_logp)^2", check=">0")
    # policy_loss icepop (arXiv 2510.18855) and m2po (arXiv 2510.01161): the rollout's log-probs against pi_old's
    icepop_low: float = opt(0.5, "icepop: tokens whose pi_old / pi_rollout is below this get no gradient", check=">=0")
    icepop_high: float = opt(5.0, "icepop: ... or above this", check=">0")
    m2_threshold: float = opt(0.04, "m2po: the tokens of largest (log pi_old - log pi_rollout)^2 are masked until the "
                                    "mean of the rest is at most this", check=">0")
    # on-policy (one mini-batch, one epoch) pi_old IS the policy being updated: its log-probs can be
    # taken, detached, from the update's own forward (trainer/stages/correction.py says when that is valid)
    old_log_probs: str = opt("auto", "where pi_old's log-probs come from: auto (the update's own forward when "
                             "on-policy and nothing reads them earlier, else a separate forward) | forward "
                             "(always the separate forward; also logs actor/entropy)", choices=("auto", "forward"))
    # GRPO-style groups: the n responses to a prompt can share one pass over the prompt in the
    # actor's and reference's forward/backward (engines/prefix.py); results are the same
    # up to floating-point summation order
    share_prompts: str = opt("auto", "run each prompt once for its responses in training forwards: auto (where "
                             "the cost model predicts >= 10% less work) | on (wherever a micro batch holds "
                             "two responses to a prompt) | off (one sequence per row)",
                             choices=("auto", "on", "off"))
    # a row whose advantages are all 0 carries no policy gradient, but would still cost a forward
    # and a backward; the rule that says when leaving it out changes nothing is
    # zero_advantage_skip_blockers below
    skip_zero_advantage_rows: bool = opt(True, "leave rows whose advantages are all 0 (e.g. a GRPO group whose "
                                         "samples got the same reward) out of the actor update's forward and "
                                         "backward; the loss still counts their tokens and sequences, so the "
                                         "update is unchanged. Only where no term reads them: not with "
                                         "actor.use_kl_loss, a nonzero actor.entropy_coeff or policy_loss "
                                         "clip_cov / kl_cov / dro (then every row runs)")
    optim: OptimConfig = section(OptimConfig)

    def check(self, job) -> List[str]:
        p = []
        if self.clip_ratio_high <= 0:
            p.append(f"actor.clip_ratio_high: must be > 0, got {self.clip_ratio_high}")
        if self.clip_ratio_c <= 1:
            p.append(f"actor.clip_ratio_c: the dual-clip bound must be > 1, got {self.clip_ratio_c}")
        if self.clip_cov_lb >= self.clip_cov_ub:
            p.append(f"actor.clip_cov_lb = {self.clip_cov_lb} must be < actor.clip_cov_ub = {self.clip_cov_ub}")
        if self.icepop_low >= self.icepop_high:
            p.append(f"actor.icepop_low = {self.icepop_low} must be < actor.icepop_high = {self.icepop_high}")
        return p + self.rollout_ratio_problems(job) + self.batch_problems(job)

    def rollout_ratio_problems(self, job) -> List[str]:
        """icepop and m2po compare pi_old with the rollout's log-probs: with those as pi_old they
        would do nothing, and IcePop's weights are themselves the rollout correction."""
        if job.trainer.job != "rl" or self.policy_loss not in ("icepop", "m2po"):
            return []
        rc, asy, p = job.algorithm.rollout_correction, job.async_training, []
        if rc.bypass_mode or (asy.off_policy and asy.objective == "behaviour"):
            why = ("algorithm.rollout_correction.bypass_mode" if rc.bypass_mode else
                   "async_training.objective = behaviour")
            p.append(f"actor.policy_loss = {self.policy_loss} compares pi_old with the rollout's log-probs, but {why} "
                     "takes pi_old to be the rollout's (the ratio would be 1): turn it off")
        if self.policy_loss == "icepop" and (rc.level(job) or rc.rollout_rs):
            p.append("actor.policy_loss = icepop already weights each token by pi_old / pi_rollout inside "
                     "[actor.icepop_low, actor.icepop_high]: set algorithm.rollout_correction.rollout_is and "
                     "rollout_rs to null")
        return p


def zero_advantage_skip_blockers(actor) -> List[str]:
    """Why the actor update must still run the rows whose advantages are all 0 (empty: it may
    leave them out). `actor`: the actor section, or anything with its fields (the policy
    objective, verl_hpc.algorithms.objectives). Conservative: any term that is nonzero, or has a
    gradient, on such a row, or that couples rows, blocks the skip. The critic never skips: a row
    with zero advantages still has value targets."""
    return [why for why, blocks in (
        ("actor.skip_zero_advantage_rows is false", not actor.skip_zero_advantage_rows),
        ("actor.use_kl_loss: the KL term has a gradient on every row", actor.use_kl_loss),
        ("actor.entropy_coeff is not 0: the entropy bonus has a gradient on every row", actor.entropy_coeff != 0),
        (f"actor.policy_loss = {actor.policy_loss} is not per row: it reads statistics of the whole micro-batch "
         "or has a term that does not vanish with the advantage", actor.policy_loss not in ROW_LOCAL_POLICY_LOSSES),
    ) if blocks]


@dataclass
class CriticConfig(TrainedRole):
    name = "critic"
    enable: Optional[bool] = opt(None, "value model", auto="on iff algorithm.adv_estimator is gae")
    model_path: str = opt("", "model the value head is added to", auto="model.path")
    cliprange_value: float = opt(0.5, "value clipping around the old values")
    loss_agg_mode: str = opt("token-mean", "how token losses become one loss", choices_from="LOSS_AGG_MODES")
    optim: OptimConfig = section(lambda: OptimConfig(lr=1e-5), "lr defaults to 1e-5")

    @staticmethod
    def wanted(job) -> bool:
        """On iff asked for, or (auto) when the advantage estimator needs values."""
        enable = job.critic.enable
        return enable if enable is not None else job.algorithm.adv_estimator == "gae"

    def check(self, job) -> List[str]:
        p = []
        if self.cliprange_value <= 0:
            p.append(f"critic.cliprange_value: must be > 0, got {self.cliprange_value}")
        if job.trainer.job == "rl" and self.enable is False and job.algorithm.adv_estimator == "gae":
            p.append("critic.enable = false, but algorithm.adv_estimator = gae needs a critic: "
                     "set critic.enable=true (or leave it null) or pick another estimator")
        if job.trainer.job == "rl" and self.wanted(job):
            p += self.batch_problems(job)
        return p

    def resolve(self, job) -> None:
        self.model_path = self.model_path or job.model.path
        self.enable = self.wanted(job)


@dataclass
class RefConfig(Section):
    enable: Optional[bool] = opt(None, "frozen reference policy",
                                 auto="on iff a KL term with a coefficient > 0 is used (algorithm.use_kl_in_reward "
                                      "or actor.use_kl_loss) or the PRM is (prm.enable: its rewards are log-ratios "
                                      "against the reference)")
    param_offload: bool = opt(False, "weights in host memory except while computing reference log-probs")

    @staticmethod
    def users(job) -> List[str]:
        """What needs reference log-probs: the KL terms and the implicit PRM. A KL term whose
        coefficient is 0 changes nothing (a fixed or adaptive controller started at 0 stays at 0), so
        it needs no reference forward (set ref.enable=true to still log the KL)."""
        a = job.algorithm
        return [k for k, on in (("algorithm.use_kl_in_reward", a.use_kl_in_reward and a.kl_ctrl.kl_coef > 0),
                                ("actor.use_kl_loss", job.actor.use_kl_loss and job.actor.kl_loss_coef > 0),
                                ("prm.enable", job.trainer.job == "rl" and job.prm.wanted(job)))
                if on]

    def check(self, job) -> List[str]:
        users = self.users(job)
        if job.trainer.job == "rl" and self.enable is False and users:
            return [f"ref.enable = false, but {' and '.join(users)} needs the reference policy"]
        return []

    def resolve(self, job) -> None:
        if self.enable is None:
            self.enable = bool(self.users(job))
