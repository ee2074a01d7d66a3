"""Tools a model calls during an episode (issue 30), and the sandbox its code runs in."""
from verl_hpc.rollout.tools.sandbox import Sandbox, SandboxResult

__all__ = ["Sandbox", "SandboxResult"]
