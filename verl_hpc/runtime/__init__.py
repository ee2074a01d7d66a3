"""Rank runtime: launcher detection, process groups, device, seeds, preemption signals."""
from verl_hpc.runtime.bootstrap import RankContext, bootstrap, shutdown
from verl_hpc.runtime.launch_env import LaunchEnv, detect
from verl_hpc.runtime.signals import PreemptionFlag

__all__ = ["LaunchEnv", "PreemptionFlag", "RankContext", "bootstrap", "detect", "shutdown"]
