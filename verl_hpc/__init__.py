"""verl_hpc: PPO/GRPO-family RL post-training of LLMs as ordinary Slurm jobs."""
__version__ = "0.1.0"
