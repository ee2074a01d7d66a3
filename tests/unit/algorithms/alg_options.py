"""The default config sections' values of the options the algorithm functions take as required
arguments (only from_config and the trainer bind a section; tests call the functions directly)."""
import inspect

from verl_hpc.algorithms import get_policy_loss
from verl_hpc.config import JobConfig

DEFAULTS = JobConfig()
ACTOR = DEFAULTS.actor
CRITIC = DEFAULTS.critic
ALGORITHM = DEFAULTS.algorithm
OVERLONG = DEFAULTS.algorithm.overlong_buffer
KL_CTRL = DEFAULTS.algorithm.kl_ctrl
PREFERENCE = DEFAULTS.algorithm.preference
ROLLOUT_CORRECTION = DEFAULTS.algorithm.rollout_correction


def pg_options(name: str, **changes):
    """The actor section's values of the options policy loss `name` requires (gspo and geo_mean
    require none: their papers' ranges are their defaults), with `changes` on top; a change the loss
    does not declare is dropped by compute_policy_loss, as the trainer's are."""
    params = inspect.signature(get_policy_loss(name)).parameters
    required = {k: getattr(ACTOR, k) for k, p in params.items()
                if p.default is inspect.Parameter.empty and hasattr(ACTOR, k)}
    return dict(required, **changes)


def adv_options(**changes):
    """The algorithm section's estimator options, as trainer/stages/advantage.py passes them to every
    estimator (each takes the ones it declares), with `changes` on top."""
    return dict(dict(gamma=ALGORITHM.gamma, lam=ALGORITHM.lam, norm_adv_by_std=ALGORITHM.norm_adv_by_std), **changes)
