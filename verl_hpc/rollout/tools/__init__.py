"""Tools for multi-turn episodes: the calls a model writes, the built-in and user tools, the
registry that offers them, the pool that runs them (docs/tools.md), the responders an episode
runner asks (turns.py; environment.py for multi_turn.environment) and the sandbox model-written code runs in (docs/sandbox.md).

    parsed = parse_tool_calls(turn_text)                  # ParsedCalls(calls, errors)
    registry = ToolRegistry.from_config(cfg.multi_turn, cfg.sandbox, allow_custom_code=cfg.safety.allow_custom_code)
    with ToolPool.from_config(cfg.multi_turn, registry, cpus_per_task=cfg.slurm.cpus_per_task) as pool:
        outcomes = pool.run([(offered_tools, call) for call in parsed.calls])
"""
from verl_hpc.rollout.tools.builtin import calculator, python_tool, run_python
from verl_hpc.rollout.tools.calls import ParsedCalls, ToolCall, ToolFailed, has_tool_call, parse_tool_calls
from verl_hpc.rollout.tools.pool import ToolOutcome, ToolPool
from verl_hpc.rollout.tools.registry import Tool, ToolRegistry, load_environment, load_user_tool
from verl_hpc.rollout.tools.sandbox import Sandbox, SandboxResult

__all__ = ["ParsedCalls", "ToolCall", "ToolFailed", "has_tool_call", "parse_tool_calls", "calculator",
           "python_tool", "run_python", "Tool", "ToolRegistry", "load_environment", "load_user_tool",
           "ToolOutcome", "ToolPool", "Sandbox", "SandboxResult"]
