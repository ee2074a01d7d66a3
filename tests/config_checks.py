"""What the config tests ask of `validate`: the problems it names for a job's overrides, or the
config it accepts. A module binds its own base overrides once:

    problems = functools.partial(config_checks.refused, base=BASE)
"""
from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.validate import validate


def found(*overrides, base=(), check_model=False) -> list[str]:
    """The problems `validate` names for `base` + `overrides` on the defaults; [] when it accepts them."""
    try:
        validate(load_config(None, [*base, *overrides]), check_model=check_model)
    except ConfigError as e:
        return e.problems
    return []


def refused(*overrides, base=(), check_model=False) -> list[str]:
    """The problems `validate` names for `base` + `overrides`; the test fails if it accepts them."""
    problems = found(*overrides, base=base, check_model=check_model)
    assert problems, f"validate accepted {[*base, *overrides]}"
    return problems


def accepted(*overrides, base=()):
    """The validated config of `base` + `overrides`; the test fails with the problems if it refuses them."""
    cfg = load_config(None, [*base, *overrides])
    validate(cfg, check_model=False)
    return cfg
