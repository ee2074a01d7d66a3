"""Megatron-Core training engine (TP/PP/DP, distributed optimizer) and its five roles.

    engine.py     MegatronEngine: forward, train_step, export, state
    wiring.py     what an engine is made of, set up in order: layout, model, LoRA, DDP, optimizer, offload
    build.py      the GPT chunks of this rank's stages (weights, value head) and their DDP wrappers
    roles.py      build_role(role, options, ...): a role (verl_hpc/engines/roles.py) on this engine
    schedule.py   micro-batches through Megatron's schedules; exact loss scaling; result broadcast
    outputs.py    log-probs / entropy from vocab-parallel logits; values / scores from a value head
    context_parallel.py  parallel.cp: Megatron's load-balanced split of each sequence, the gather back
    value_head.py the hidden -> 1 head of critics and reward models
    sdpa.py       causal core attention through torch SDPA for the local (CPU) layer spec
    optim.py      optimizer config, LR schedule, the guarded (non-finite skipping) step
    state.py      layout-independent state slabs for HDF5 checkpoints

Imports: megatron.core (and transformers, vLLM) are imported inside the functions that use them,
here and in verl_hpc.models, verl_hpc.parallel and verl_hpc.rollout; these are the only
function-level imports there. Importing verl_hpc must not need them: each costs seconds, and the
submit CLI, the checkpoint tools and the unit tests of the pure parts never touch them. The
project's own modules and torch are imported at the top.
"""
from verl_hpc.engines.megatron.engine import MegatronEngine
from verl_hpc.engines.options import EngineOptions, default_options
from verl_hpc.engines.megatron.roles import build_role
from verl_hpc.engines.roles import Actor, Critic, ProcessRewardModel, Reference, RewardModel

__all__ = ["Actor", "Critic", "EngineOptions", "MegatronEngine", "ProcessRewardModel", "Reference", "RewardModel",
           "build_role", "default_options"]
