"""Named algorithm recipes and the valid algorithm names, as plain data.

A recipe is a nested dict of config overrides (sections `algorithm`, `actor`, `rollout`, `critic`)
applied over the dataclass defaults and under the user's YAML (`algorithm.recipe: grpo`).
Values follow each method's paper; where a paper gives no number, verl's example configs
(`examples/*_trainer/`) or defaults are used, and a comment says so. docs/algorithms.md has the table.

This module imports nothing from verl_hpc (nor torch) so that config can validate names cheaply;
tests/unit/algorithms/test_alg_registry_recipes.py checks that the name tuples equal the algorithm registries.
"""

# Names of verl_hpc.algorithms' registries (order is for display only).
ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "remax",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "opo",
    "gpg",
    "grpo_passk",
    "prime",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
)
POLICY_LOSSES = ("vanilla", "gspo", "cispo", "gpg", "reinforce", "clip_cov", "kl_cov", "geo_mean", "sapo",
                 "dppo_tv", "dppo_kl", "dro", "icepop", "m2po")
# The policy losses whose rows are independent: a row's loss reads only its own tokens and is
# -A x (something finite), so a row whose advantages are all 0 adds exactly 0 to the loss and its
# gradient (actor.skip_zero_advantage_rows). clip_cov / kl_cov are not here: their token
# selection reads statistics of the whole micro-batch, so removing a row changes other rows' loss;
# nor is dro: its penalty (logp - old_logp)^2 is not multiplied by A. m2po's mask is a statistic of
# the whole batch too, but computed once per step before the update (algorithms/m2po.py), so its
# loss is per row. A new loss is left out until it is shown to belong
# (tests/unit/engines/test_eng_zero_adv_skip.py).
ROW_LOCAL_POLICY_LOSSES = ("vanilla", "gspo", "cispo", "gpg", "reinforce", "geo_mean", "sapo", "dppo_tv", "dppo_kl",
                           "icepop", "m2po")
# Losses that weight each token by pi_old / pi_rollout themselves (IcePop's M(k)): split placement's
# decoupled objective applies no proximal / behaviour token weights on top of them.
BEHAVIOUR_WEIGHTED_POLICY_LOSSES = ("icepop",)
# Estimators that read pi_old's log-probs and the engine's sum_v pi_v^2 of every response token:
# the actor's old-log-prob forward computes it for them (before the advantages).
SUM_PI_SQUARED_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
# Short names and verl's names for the same estimators: k1=kl, k2=mse, k3=low_var_kl; "+": the
# value of k1/k3 with k2's gradient (straight-through).
KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+")
LOSS_AGG_MODES = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
)

_NO_KL_CTRL = {"type": "fixed", "kl_coef": 0.0, "target_kl": 0.1, "horizon": 10000}
_NO_OVERLONG = {"enable": False, "len": 0, "penalty_factor": 1.0}
_NO_ACC_FILTER = {"enable": False, "low": 0.2, "high": 0.8}

RECIPES = {
    # InstructGPT (Ouyang et al. 2022, arXiv 2203.02155): PPO with a critic and GAE (gamma=1,
    # lam=0.95), per-token KL penalty in the reward with a fixed beta=0.02, clip 0.2.
    "ppo": {
        "algorithm": {
            "adv_estimator": "gae", "gamma": 1.0, "lam": 0.95, "norm_adv_by_std": True,
            "use_kl_in_reward": True, "kl_penalty": "kl",
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.02, "target_kl": 0.1, "horizon": 10000},
            "filter_groups": False, "overlong_buffer": dict(_NO_OVERLONG),
            "accuracy_filter": dict(_NO_ACC_FILTER),
        },
        "actor": {
            "policy_loss": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
            "loss_agg_mode": "token-mean", "entropy_coeff": 0.0,
            "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 1},
        "critic": {"enable": True},
    },
    # GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300): 64 samples per question, group
    # z-scored outcome advantage, KL as a loss with the k3 estimator and beta=0.04, per-sequence
    # mean of token losses then mean over the group (seq-mean-token-mean), clip 0.2.
    "grpo": {
        "algorithm": {
            "adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": True,
            "use_kl_in_reward": False, "kl_penalty": "kl", "kl_ctrl": dict(_NO_KL_CTRL),
            "filter_groups": False, "overlong_buffer": dict(_NO_OVERLONG),
            "accuracy_filter": dict(_NO_ACC_FILTER),
        },
        "actor": {
            "policy_loss": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
            "loss_agg_mode": "seq-mean-token-mean", "entropy_coeff": 0.0,
            "use_kl_loss": True, "kl_loss_coef": 0.04, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 64},
        "critic": {"enable": False},
    },
    # Dr.GRPO ("Understanding R1-Zero-Like Training", Liu et al. 2025, arXiv 2503.20783): GRPO
    # without the std division and without length normalisation (token sums over a constant), no KL.
    # n=8 as in the paper's Oat-Zero runs.
    "dr_grpo": {
        "algorithm": {
            "adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": False,
            "use_kl_in_reward": False, "kl_penalty": "kl", "kl_ctrl": dict(_NO_KL_CTRL),
            "filter_groups": False, "overlong_buffer": dict(_NO_OVERLONG),
            "accuracy_filter": dict(_NO_ACC_FILTER),
        },
        "actor": {
            "policy_loss": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
            "loss_agg_mode": "seq-mean-token-sum-norm", "entropy_coeff": 0.0,
            "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 8},
        "critic": {"enable": False},
    },
    # DAPO (Yu et al. 2025, arXiv 2503.14476): clip-higher (0.2 / 0.28), dynamic sampling, token-level
    # loss, overlong shaping with a 4096-token buffer and factor 1.0, no KL, 16 samples per prompt.
    # clip_ratio_c=10.0 is from verl's DAPO recipe (the paper has no dual clip).
    "dapo": {
        "algorithm": {
            "adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": True,
            "use_kl_in_reward": False, "kl_penalty": "kl", "kl_ctrl": dict(_NO_KL_CTRL),
            "filter_groups": True, "overlong_buffer": {"enable": True, "len": 4096, "penalty_factor": 1.0},
            "accuracy_filter": dict(_NO_ACC_FILTER),
        },
        "actor": {
            "policy_loss": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0,
            "loss_agg_mode": "token-mean", "entropy_coeff": 0.0,
            "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 16},
        "critic": {"enable": False},
    },
    # RLOO ("Back to Basics", Ahmadian et al. 2024, arXiv 2402.14740): k=4 samples, leave-one-out
    # baseline, the whole response is one action (sum of token log-probs per sequence), no clipping,
    # KL (k1) in the reward. beta=0.001 is verl's RLOO example value (the paper tunes it per task).
    "rloo": {
        "algorithm": {
            "adv_estimator": "rloo", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": True,
            "use_kl_in_reward": True, "kl_penalty": "kl",
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000},
            "filter_groups": False, "overlong_buffer": dict(_NO_OVERLONG),
            "accuracy_filter": dict(_NO_ACC_FILTER),
        },
        "actor": {
            "policy_loss": "reinforce", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
            "loss_agg_mode": "seq-mean-token-sum", "entropy_coeff": 0.0,
            "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 4},
        "critic": {"enable": False},
    },
    # ReMax (Li et al. 2023, arXiv 2310.10505): one sampled response per prompt, baseline = reward of
    # the greedy response, REINFORCE on the whole sequence, no clipping. KL (k1) in the reward with
    # verl's ReMax example beta=0.001.
    "remax": {
        "algorithm": {
            "adv_estimator": "remax", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": True,
            "use_kl_in_reward": True, "kl_penalty": "kl",
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000},
            "filter_groups": False, "overlong_buffer": dict(_NO_OVERLONG),
            "accuracy_filter": dict(_NO_ACC_FILTER),
        },
        "actor": {
            "policy_loss": "reinforce", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
            "loss_agg_mode": "seq-mean-token-sum", "entropy_coeff": 0.0,
            "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 1},
        "critic": {"enable": False},
    },
    # REINFORCE++ (Hu 2025, arXiv 2501.03262): one response per prompt, per-token k1 KL penalty in
    # the reward, returns whitened over the global batch, PPO clip 0.2 kept, token-level loss.
    # beta=0.001 is verl's default kl_coef.
    "reinforce_pp": {
        "algorithm": {
            "adv_estimator": "reinforce_plus_plus", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": True,
            "use_kl_in_reward": True, "kl_penalty": "kl",
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000},
            "filter_groups": False, "overlong_buffer": dict(_NO_OVERLONG),
            "accuracy_filter": dict(_NO_ACC_FILTER),
        },
        "actor": {
            "policy_loss": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
            "loss_agg_mode": "token-mean", "entropy_coeff": 0.0,
            "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 1},
        "critic": {"enable": False},
    },
    # GSPO (Qwen team, Zheng et al. 2025, arXiv 2507.18071): GRPO advantages, sequence-level
    # geometric-mean ratio clipped to [1 - 3e-4, 1 + 4e-4], per-sequence mean aggregation, no KL.
    # n=16 as in verl's GSPO example.
    "gspo": {
        "algorithm": {
            "adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": True,
            "use_kl_in_reward": False, "kl_penalty": "kl", "kl_ctrl": dict(_NO_KL_CTRL),
            "filter_groups": False, "overlong_buffer": dict(_NO_OVERLONG),
            "accuracy_filter": dict(_NO_ACC_FILTER),
        },
        "actor": {
            "policy_loss": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "clip_ratio_c": 3.0,
            "loss_agg_mode": "seq-mean-token-mean", "entropy_coeff": 0.0,
            "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 16},
        "critic": {"enable": False},
    },
    # PRIME (Cui et al. 2025, arXiv 2502.01456): implicit process rewards from a PRM trained online
    # (the prm section: beta 0.05, CE loss, updated before the rewards, coefficients 5 and 5),
    # process and outcome rewards each with a leave-one-out baseline, groups kept only when their
    # accuracy is in [0.2, 0.8], PPO clip 0.2, no KL, 4 samples per prompt (verl's PRIME recipe).
    "prime": {
        "algorithm": {
            "adv_estimator": "prime", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std": True,
            "use_kl_in_reward": False, "kl_penalty": "kl", "kl_ctrl": dict(_NO_KL_CTRL),
            "filter_groups": False, "overlong_buffer": dict(_NO_OVERLONG),
            "accuracy_filter": {"enable": True, "low": 0.2, "high": 0.8},
        },
        "actor": {
            "policy_loss": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
            "loss_agg_mode": "token-mean", "entropy_coeff": 0.0,
            "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl",
        },
        "rollout": {"n": 4},
        "critic": {"enable": False},
    },
}

RECIPE_NAMES = tuple(RECIPES)
