"""Whether a checkpoint holds the engine's model: the check both engines make in `load_state`
before anything is changed.

A load fills the slabs the engine asks for, so a checkpoint that lacks one of them or holds it at
another shape fails at the reader; one that holds MORE (a deeper model, an untied output layer,
biases this architecture does not have) would load without a word and resume a model that is not
the one trained. The loader the checkpointer hands an engine (verl_hpc.checkpoint.checkpointer.
RoleLoader) lists what the checkpoint holds for the role, and this compares the two sets of
`model/` tensors by name and global shape, naming the first tensor that differs. A plain callable
(tests that fill slabs from memory) has no list: nothing to compare.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from verl_hpc.checkpoint.errors import CheckpointMismatchError

MODEL = "model/"
MAIN = "optim/main/"  # fp32 master weights: the same tensors as model/ (engines/base.py)


def model_shapes(slabs: Sequence[Any]) -> dict:
    """{model/<name>: global shape} of the parameters among an engine's load slabs (a master
    weight target optim/main/<name> counts as its model/<name>)."""
    out = {}
    for s in slabs:
        name = s.name
        if name.startswith(MAIN):
            name = MODEL + name[len(MAIN):]
        if name.startswith(MODEL):
            out[name] = tuple(s.global_shape)
    return out


def _union_over_ranks(wanted: Mapping[str, tuple]) -> dict:
    """Every rank's wanted tensors (a pipeline stage holds its own layers only), so that every
    rank compares the whole model and all of them refuse alike, or none."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(wanted)
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, dict(wanted))
    return {n: s for part in box for n, s in part.items()}


def check_same_model(load_into: Callable, wanted: Mapping[str, tuple], model: str) -> None:
    """Raise CheckpointMismatchError (one line) when the checkpoint's model tensors are not
    exactly `wanted` (model_shapes of the engine's slabs) on the ranks together; `model` names the
    engine's model. Collective when the loader lists what it holds (every rank loads)."""
    stored_of = getattr(load_into, "stored", None)
    if stored_of is None:
        return
    wanted = _union_over_ranks(wanted)
    stored = {n: tuple(s) for n, s in stored_of().items() if n.startswith(MODEL)}
    where = getattr(load_into, "where", "the checkpoint")
    hint = "it is of another model; resume with the model it was trained on (the run's model.path)"
    for name in sorted(wanted):
        if name not in stored:
            raise CheckpointMismatchError(f"{where}: holds no {name} (shape {list(wanted[name])}), which "
                                          f"{model} has: {hint}")
        if stored[name] != tuple(wanted[name]):
            raise CheckpointMismatchError(f"{where}: {name} has shape {list(stored[name])}; {model} has "
                                          f"{list(wanted[name])}: {hint}")
    extra = sorted(set(stored) - set(wanted))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointMismatchError(f"{where}: {extra[0]}{more} has no place in {model}: {hint}")
