"""Job configuration: typed schema, YAML + extends + CLI overrides + recipes, validation.

    cfg = load_config("configs/smoke.yaml", ["trainer.total_steps=10"])  # typed, recipe applied
    validate(cfg, check_model=True)      # semantic + layout checks; one ConfigError for all problems
    text = to_yaml(cfg); d = to_container(cfg); cfg2 = from_container(d)

Every bad input raises `ConfigError` (a ValueError) with one human line per problem.
"""
from verl_hpc.config.errors import ConfigError
from verl_hpc.config.loader import from_container, load_config, parse_override, to_container, to_yaml
from verl_hpc.config.schema import JobConfig
from verl_hpc.config.validate import read_model_shape, validate

__all__ = [
    "ConfigError",
    "JobConfig",
    "from_container",
    "load_config",
    "parse_override",
    "read_model_shape",
    "to_container",
    "to_yaml",
    "validate",
]
