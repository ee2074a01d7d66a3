"""From a validated config to running ranks: the plan, then Slurm (submitit) or local ranks."""
