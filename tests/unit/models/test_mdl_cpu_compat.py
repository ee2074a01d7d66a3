"""verl_hpc.parallel.cpu_compat: its targets are still what was verified, and its replacements
keep Megatron's semantics on CPU.

The pin file (mdl_cpu_compat_pins.json) records, for megatron-core 0.16.1:
- every CUDA touch point (torch.cuda.X, device="cuda", .cuda(), 'torch.cuda.*Tensor') in each
  module whose `torch` cpu_compat replaces, by enclosing function;
- a source hash of every function cpu_compat replaces or relies on (RNG tracker, type checks,
  the tied-embedding setup).
A new megatron-core release that moves any of them fails here with the exact difference. Then:
re-check each difference against verl_hpc/parallel/cpu_compat.py (does the CPU stand-in still
cover it?), and regenerate the pins with
    .venv/bin/python tests/unit/models/test_mdl_cpu_compat.py --write-pins
"""
import ast
import hashlib
import importlib
import inspect
import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from verl_hpc.parallel import cpu_compat

PINS = Path(__file__).with_name("mdl_cpu_compat_pins.json")
RECHECK = ("megatron-core changed a target of verl_hpc/parallel/cpu_compat.py (verified against "
           "0.16.1). Re-check the difference below against cpu_compat's CPU stand-ins, then "
           "regenerate the pins: .venv/bin/python tests/unit/models/test_mdl_cpu_compat.py "
           "--write-pins\n")
RELIED_ON = [  # functions whose behaviour the CPU RNG tracker depends on
    f"{cpu_compat.RNG_MODULE}:{name}" for name in (
        "CudaRNGStatesTracker.__init__", "CudaRNGStatesTracker.reset",
        "CudaRNGStatesTracker.get_states", "CudaRNGStatesTracker.set_states",
        "CudaRNGStatesTracker.add", "CudaRNGStatesTracker.fork", "initialize_rng_tracker",
        "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "_get_cuda_rng_state",
        "_set_cuda_rng_state")]


def _touch_points(module_name: str):
    """Sorted "Qualified.function: touch" strings for every CUDA use in a module's source."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            touch = None
            if (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Attribute)
                    and child.value.attr == "cuda" and isinstance(child.value.value, ast.Name)
                    and child.value.value.id == "torch"):
                touch = f"torch.cuda.{child.attr}"
            elif (isinstance(child, ast.keyword) and child.arg == "device"
                  and isinstance(child.value, ast.Constant) and str(child.value.value).startswith("cuda")):
                touch = f"device={child.value.value!r}"
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                  and child.func.attr == "cuda"):
                touch = ".cuda()"
            elif isinstance(child, ast.Constant) and child.value in cpu_compat.CPU_TYPE_NAMES:
                touch = repr(child.value)
            if touch:
                found.append(f"{scope or '<module>'}: {touch}")
            visit(child, inner)

    visit(tree, "")
    return sorted(found)


def _source_hash(target: str) -> str:
    source = textwrap.dedent(inspect.getsource(cpu_compat.resolve_function(target)))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def current_pins():
    hashed = (RELIED_ON + list(cpu_compat.TYPE_NAME_FUNCTIONS)
              + list(cpu_compat.SCOPED_TENSOR_CUDA) + list(cpu_compat.CPU_FUNCTIONS))
    return {"touch_points": {m: _touch_points(m) for m in cpu_compat.TORCH_PROXY_MODULES},
            "source_sha256": {t: _source_hash(t) for t in hashed}}


def test_megatron_targets_unchanged():
    pinned, now = json.loads(PINS.read_text()), current_pins()
    problems = []
    for module in sorted(set(pinned["touch_points"]) | set(now["touch_points"])):
        # multisets: a second identical use inside the same function is a change too
        old = Counter(pinned["touch_points"].get(module, []))
        new = Counter(now["touch_points"].get(module, []))
        problems += [f"{module}: new CUDA use   {x}" for x in sorted((new - old).elements())]
        problems += [f"{module}: CUDA use gone  {x}" for x in sorted((old - new).elements())]
    for target in sorted(set(pinned["source_sha256"]) | set(now["source_sha256"])):
        if pinned["source_sha256"].get(target) != now["source_sha256"].get(target):
            problems.append(f"{target}: source changed (or target added/removed)")
    assert not problems, RECHECK + "\n".join(problems)


@pytest.fixture
def patched():
    """cpu_compat applied in this process, undone afterwards (other tests see plain megatron)."""
    cpu_compat.revert()
    records = cpu_compat.apply(force=True)
    yield records
    cpu_compat.revert()


def test_apply_is_idempotent_and_reverts(patched):
    import megatron.core.utils as mutils

    assert cpu_compat.apply(force=True) == patched  # a second call changes nothing
    assert {r.kind for r in patched} == {"rng-tracker", "rng-state-helper", "module-torch",
                                         "scoped-tensor-cuda", "type-names", "function"}
    assert mutils.torch is not torch
    cpu_compat.revert()
    assert mutils.torch is torch and cpu_compat.applied() == ()


def test_rng_tracker_keeps_megatron_semantics(patched):
    from megatron.core import tensor_parallel as tpar
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tpar.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tpar.get_cuda_rng_tracker()
    assert isinstance(tracker, CudaRNGStatesTracker)  # megatron's isinstance checks still hold
    torch.manual_seed(5)
    outer = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer), "fork must restore the default stream"
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b), "a forked stream continues where it stopped"
    tpar.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    with tracker.fork():
        assert torch.equal(torch.rand(4), a), "same seed, same stream"
    tpar.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0)
    with tracker.fork():
        assert not torch.equal(torch.rand(4), a), "TP ranks get different model-parallel streams"
    with pytest.raises(Exception, match="already exists"):
        tracker.add("model-parallel-rng", 999)


def test_allocations_and_type_checks_land_on_cpu(patched):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer, local_multi_tensor_l2_norm

    assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "t").device.type == "cpu"
    assert get_default_causal_mask(5).device.type == "cpu"
    norm, _ = local_multi_tensor_l2_norm(0, None, [[torch.ones(4)]], False)
    assert norm.device.type == "cpu" and float(norm) == pytest.approx(2.0)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)  # rejected CPU grads before
    assert torch.allclose(p.grad, torch.full((3,), 0.5), atol=1e-5)


def test_unknown_cuda_use_fails_loudly(patched):
    import megatron.core.utils as mutils

    assert mutils.torch.cuda.current_device() == torch.device("cpu")
    assert mutils.torch.zeros(2, device="cuda").device.type == "cpu"
    with pytest.raises(AttributeError, match="no CPU stand-in"):
        mutils.torch.cuda.mem_get_info()


def test_moe_dispatcher_stand_ins(patched):
    """The alltoall token dispatcher's CUDA habits on CPU: its device-to-host stream is the one
    stream (no side-stream bookkeeping), the event it records is complete, and its split sizes
    come back as the sequence all_to_all_single takes."""
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher as td

    stream = td.torch.cuda.Stream()
    assert td.torch.cuda.current_stream() == stream  # "on a side stream?" -> no
    stream.record_event().synchronize()
    splits = td.maybe_move_tensor_to_cpu(torch.tensor([3, 5]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 5]
    same = torch.tensor([1])
    assert td.maybe_move_tensor_to_cpu(same) is same


if __name__ == "__main__" and "--write-pins" in sys.argv:
    PINS.write_text(json.dumps(current_pins(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINS}")
