"""The sections of a job config, one module per concern; `verl_hpc.config.schema.JobConfig` joins them.

Each section class owns its fields (declared with `opt`: default, help, choices or range, auto),
the rules between its fields (`check`) and its auto values (`resolve`).
"""
