"""Every torch.distributed collective, named and counted.

`install()` (called by `runtime.bootstrap`) replaces the collectives in the `torch.distributed`
namespace with thin wrappers, so that calls from Megatron-Core, vLLM and this project alike:
  * fail with an error that names the collective, the group (tp/dp/pp/... or its ranks), this rank
    and how long it waited: a bare gloo/NCCL timeout says neither which collective nor which group
    hung, and on a multi-node job that is the first thing to know (which link, which layout);
  * are counted: calls and payload bytes per (collective, group), read by benchmarks/bench_scaling.py
    and compared with the analytical formulas in docs/scaling.md.
torch's functional collectives are plain functions that call their c10d ops directly, not
through the namespace: the one this project calls, `all_to_all_single_autograd` (the Ulysses
regrouping of engines/fsdp/ulysses.py), is wrapped in its own module and counted as
`all_to_all_single`, its backward (the same exchange of the output's gradient, run by autograd
in C++) by a hook on the output's gradient.
The wrappers look the real function up at call time's closure and cost a dict update per call.
torch has no hook API for this (its c10d logger only logs), hence the wrapping.

A wrapper never changes what a collective does or returns: it hands back torch's own object, the
Work of an `async_op=True` call included. Inside `_coalescing_manager` torch returns a placeholder
(`_IllegalWork`) whose every attribute access raises; FSDP2 tests `isinstance(work, Work)` to know
whether to wait; C++ code takes the Work itself. So an error that surfaces only in an async
`wait()` is not renamed here (NCCL's watchdog names the collective and its sequence number), and
the wrapper never looks at what torch returned. Which collectives FSDP2, Megatron and the project
reach on the installed torch is tested (tests/unit/test_collectives.py): a torch upgrade that adds
a path the table below does not know fails there, not silently in the counts.

Payload bytes are what the caller hands to the collective on this rank, not what crosses a wire:
all_reduce/broadcast/send/recv: the tensor; reduce_scatter: the full input; all_gather: the full
output. The wire traffic follows from the algorithm (ring: 2(n-1)/n of the payload for all-reduce,
(n-1)/n for reduce-scatter and all-gather) and is applied in the formulas, not here.
"""
from __future__ import annotations

import collections
import functools
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from verl_hpc.errors import VerlHpcError

_TENSOR_ARG = {  # collective -> how to find its payload tensor(s)
    "all_reduce": lambda a, k: _arg(a, k, 0, "tensor"),
    "broadcast": lambda a, k: _arg(a, k, 0, "tensor"),
    "reduce": lambda a, k: _arg(a, k, 0, "tensor"),
    "send": lambda a, k: _arg(a, k, 0, "tensor"),
    "recv": lambda a, k: _arg(a, k, 0, "tensor"),
    "reduce_scatter_tensor": lambda a, k: _arg(a, k, 1, "input"),
    "_reduce_scatter_base": lambda a, k: _arg(a, k, 1, "input"),
    "all_gather_into_tensor": lambda a, k: _arg(a, k, 0, "output_tensor"),
    "_all_gather_base": lambda a, k: _arg(a, k, 0, "output_tensor"),
    "all_gather_single": lambda a, k: _arg(a, k, 0, "output_tensor"),  # FSDP2's (torch >= 2.13)
    "reduce_scatter_single": lambda a, k: _arg(a, k, 1, "input"),  # FSDP2's (torch >= 2.13)
    "all_reduce_coalesced": lambda a, k: _arg(a, k, 0, "tensors"),
    "all_gather_coalesced": lambda a, k: _arg(a, k, 0, "output_tensor_lists"),
    "all_to_all": lambda a, k: _arg(a, k, 1, "input_tensor_list"),
    "gather": lambda a, k: _arg(a, k, 0, "tensor"),
    "scatter": lambda a, k: _arg(a, k, 0, "tensor"),
    "all_gather": lambda a, k: _arg(a, k, 0, "tensor_list"),
    "reduce_scatter": lambda a, k: _arg(a, k, 1, "input_list"),
    "all_to_all_single": lambda a, k: _arg(a, k, 1, "input"),
    "barrier": lambda a, k: None,
    "all_gather_object": lambda a, k: None,
    "broadcast_object_list": lambda a, k: None,
    "batch_isend_irecv": lambda a, k: [op.tensor for op in _arg(a, k, 0, "p2p_op_list") or []],
}
# collectives whose group may be given positionally (found among the arguments by type)
_GROUP_POSITIONAL = ("all_reduce", "reduce_scatter_tensor", "_reduce_scatter_base", "all_gather_into_tensor",
                     "_all_gather_base", "all_gather", "reduce_scatter", "barrier", "all_gather_single",
                     "reduce_scatter_single", "all_reduce_coalesced", "all_gather_coalesced", "all_to_all",
                     "gather", "scatter")
# isend/irecv stay unwrapped: torch.distributed.P2POp accepts only the very function objects
# isend/irecv as its `op` (a wrapper fails its check), so point-to-point traffic is counted where
# the batch is handed over (batch_isend_irecv, which Megatron's pipeline schedules use) and in
# the blocking send/recv.
_lock = threading.Lock()
_counts: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
# held weakly: a name must not keep a destroyed group (its gloo threads, its store) alive
_names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_timeout_s: float | None = None
_installed = False


class CollectiveError(VerlHpcError, RuntimeError):
    """A collective failed or timed out; the message names it, its group and this rank."""

    exit_code, kind = 19, "collective"


def _arg(args, kwargs, pos, name):
    return args[pos] if len(args) > pos else kwargs.get(name)


def _nbytes(obj) -> int:
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def name_group(group, name: str) -> None:
    """Give a process group a readable name (tp, dp, pp, ...) for counts and errors."""
    if group is not None:
        _names[group] = name


def group_name(group) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    try:
        name = _names.get(group)
    except TypeError:  # a functional collective's group given as a list of ranks
        name = None
    if name:
        return name
    try:
        return "ranks" + str(dist.get_process_group_ranks(group)).replace(" ", "")
    except Exception:  # a group this rank is not in, or torch internals changed
        return "unnamed"


def _describe(op: str, group) -> str:
    try:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    except Exception:
        ranks = "?"
    return f"'{group_name(group)}' (ranks {ranks})"


def _fail(op: str, group, t0: float, err: BaseException):
    rank = dist.get_rank() if dist.is_initialized() else -1
    raise CollectiveError(
        f"collective {op} on group {_describe(op, group)} failed on rank {rank} after "
        f"{time.monotonic() - t0:.1f}s (collective timeout {_timeout_s or '?'}s): "
        f"{type(err).__name__}: {err}") from err


def _wrap(op: str, fn: Callable) -> Callable:
    payload = _TENSOR_ARG[op]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if group is None and op in _GROUP_POSITIONAL:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        key = (op, group_name(group))
        tensors = payload(args, kwargs)
        _count(key, _nbytes(tensors))
        _check_device(op, group, tensors)
        t0 = time.monotonic()
        try:
            out = fn(*args, **kwargs)
        except CollectiveError:
            raise
        except Exception as err:  # noqa: BLE001 - re-raised with the name
            _fail(op, group, t0, err)
        return out  # torch's own object, never touched (a coalescing placeholder raises on any access)

    wrapper.__wrapped_collective__ = fn
    return wrapper


def _flat(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat(o)]
    return []


def _check_device(op: str, group, tensors) -> None:
    """NCCL takes CUDA tensors only, and its own error for a host tensor names neither the
    collective nor the group: refuse here, naming both (a group whose backend also has gloo for
    the CPU, runtime.device.process_group_backend, takes host tensors)."""
    host = [t for t in _flat(tensors) if t.device.type == "cpu"]
    if not host:
        return
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # a group this rank is not in: torch's own error follows
        return
    if backend == "nccl":
        rank = dist.get_rank() if dist.is_initialized() else -1
        raise CollectiveError(f"collective {op} on group {_describe(op, group)} on rank {rank}: a host tensor "
                              f"({tuple(host[0].shape)}, {host[0].dtype}) on an NCCL group, which takes CUDA "
                              f"tensors only; create it on runtime.device.collective_device()")


def _count(key: tuple[str, str], nbytes: int) -> None:
    with _lock:
        c = _counts[key]
        c[0] += 1
        c[1] += nbytes


def _wrap_functional_all_to_all(fn: Callable) -> Callable:
    """all_to_all_single_autograd(input, output_split_sizes, input_split_sizes, group): the input
    counted when it is called, the output's gradient when autograd hands it to the backward's
    all_to_all (the payload of that exchange)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = _arg(args, kwargs, 3, "group")
        key = ("all_to_all_single", group_name(group))
        _count(key, _nbytes(_arg(args, kwargs, 0, "input")))
        t0 = time.monotonic()
        try:
            out = fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised with the name
            _fail("all_to_all_single", group, t0, err)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: _count(key, _nbytes(grad)))
        return out

    wrapper.__wrapped_collective__ = fn
    return wrapper


def install(timeout_s: float | None = None) -> None:
    """Wrap the collectives of torch.distributed (once per process)."""
    global _installed, _timeout_s
    _timeout_s = timeout_s if timeout_s is not None else _timeout_s
    if _installed:
        return
    for op in _TENSOR_ARG:
        fn = getattr(dist, op, None)
        if fn is not None and not hasattr(fn, "__wrapped_collective__"):
            setattr(dist, op, _wrap(op, fn))
    from torch.distributed import _functional_collectives as funcol

    fn = getattr(funcol, "all_to_all_single_autograd", None)
    if fn is not None and not hasattr(fn, "__wrapped_collective__"):
        funcol.all_to_all_single_autograd = _wrap_functional_all_to_all(fn)
    _installed = True


def counts() -> dict[tuple[str, str], tuple[int, int]]:
    """{(collective, group): (calls, payload bytes)} on this rank since the last reset()."""
    with _lock:
        return {k: (v[0], v[1]) for k, v in _counts.items()}


def reset() -> None:
    with _lock:
        _counts.clear()
