"""multi_turn's section made into an episode runner, in two steps:

    parts = episode_parts(options, ctx, tokenizer)            # before any engine (None without multi_turn)
    runner = build_episode_runner(options, ctx, engine, parts)

`options` is an EpisodeOptions: the multi_turn and sandbox sections and the values the episodes read
from other sections (the trainer builds it from the job config: verl_hpc/trainer/roles.py).

`episode_parts` holds all that can fail: the chat template's delimiters (TurnCodec), the tool
registry (user tools that do not import, two tools of one name), the environment class, the
sandbox. The roles build it before the rollout engine and the training engines, so such a job
fails in seconds and with no engine up (docs/errors.md); the runner itself only puts them together.

Only rank 0 runs tools (their output is broadcast, verl_hpc/rollout/episodes/runner.py), so only rank 0
builds the registry, the sandbox and the pool of tool workers; the other ranks get a responder
that applies rank 0's replies.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from verl_hpc.rollout.episodes.chat_turns import TurnCodec
from verl_hpc.rollout.episodes.runner import EpisodeRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeOptions:
    """What multi_turn's episodes are built from: its section, the sandbox's, and each value read
    from another section, named by the field it comes from."""
    multi_turn: Any  # the multi_turn section
    sandbox: Any  # the sandbox section (the python tool's)
    allow_custom_code: bool  # safety.allow_custom_code (user tools, environments)
    on_error: str  # reward.on_error (an environment step that raises)
    cpus_per_task: int  # slurm.cpus_per_task (the tool workers)
    budget: int  # data.max_response_length (an episode's tokens)


class _Remote:
    """The responder of a rank that is not rank 0: it never runs (rank 0's replies arrive)."""

    def __init__(self, role: str, stop: tuple):
        self.role, self.stop = role, stop

    def start(self, rows) -> None:
        pass

    def respond(self, turns):
        raise RuntimeError("only rank 0 runs tools")

    def close(self) -> None:
        pass


def build_responder(o: EpisodeOptions):
    """What answers the model's turns on rank 0: the environment, or the tools in their pool."""
    from verl_hpc.rollout.tools.environment import EnvironmentTurns
    from verl_hpc.rollout.tools.pool import ToolPool
    from verl_hpc.rollout.tools.registry import ToolRegistry, load_environment
    from verl_hpc.rollout.tools.turns import ToolTurns

    mt = o.multi_turn
    if mt.environment:
        return EnvironmentTurns(load_environment(mt.environment, o.allow_custom_code), mt.environment,
                                on_error=o.on_error)
    registry = ToolRegistry.from_config(mt, o.sandbox, allow_custom_code=o.allow_custom_code)
    if "python" in registry.names():
        log.info("multi_turn: the python tool runs in the sandbox: %s", registry.sandbox.describe())
    return ToolTurns(ToolPool.from_config(mt, registry, cpus_per_task=o.cpus_per_task),
                     max_calls_per_turn=mt.max_calls_per_turn,
                     error_penalty=mt.tool_error_penalty)


def episode_parts(o: EpisodeOptions, ctx, tokenizer) -> Optional[Tuple[TurnCodec, Any]]:
    """(codec, this rank's responder) for multi_turn.enable, else None. The caller closes the
    responder if it does not hand the parts to a runner."""
    mt = o.multi_turn
    if not mt.enable:
        return None
    codec = TurnCodec(tokenizer)
    return codec, (build_responder(o) if ctx.rank == 0 else _Remote(*_shape(mt)))


def build_episode_runner(o: EpisodeOptions, ctx, engine, parts) -> Optional[EpisodeRunner]:
    """The runner over `engine` (None without parts: every sample is one response)."""
    if parts is None:
        return None
    mt = o.multi_turn
    codec, responder = parts
    is_root = ctx.rank == 0
    runner = EpisodeRunner(engine, codec, responder, max_turns=mt.max_turns,
                           budget=o.budget, timeout_s=mt.episode_timeout_s,
                           default_tools=offered_tools(mt), is_root=is_root)
    if is_root:
        log.info("multi_turn: episodes of up to %d model turns and %d tokens; %s", mt.max_turns,
                 o.budget,
                 f"environment {mt.environment}" if mt.environment else f"tools {', '.join(offered_tools(mt))}")
    return runner


def _shape(mt) -> tuple:
    """(role, stop strings) of the responder rank 0 builds, without building it."""
    from verl_hpc.rollout.tools.environment import EnvironmentTurns
    from verl_hpc.rollout.tools.turns import ToolTurns

    kind = EnvironmentTurns if mt.environment else ToolTurns
    return kind.role, kind.stop


def offered_tools(multi_turn) -> list:
    """The tools a row that names none is offered: the built-ins listed (multi_turn.tools) and every
    user tool (multi_turn.user_tools)."""
    return [*multi_turn.tools, *(spec.partition(":")[2] for spec in multi_turn.user_tools)]
