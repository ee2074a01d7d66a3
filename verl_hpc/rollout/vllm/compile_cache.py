"""vLLM's compilation (rollout.enforce_eager false) kept in the job's folder, so that a restarted job
(a requeue, a resume, a rebuilt engine) loads what its first start compiled.

What a compiling engine reads, set before it is built (the user's own values win):
- TORCHINDUCTOR_CACHE_DIR = <folder>/inductor. On CPU vLLM compiles the model with torch.compile's
  inductor backend directly (mode DYNAMO_TRACE_ONCE, no CUDA graphs), whose FX-graph and kernel
  caches live there; torch's default is a folder under /tmp, which a compute node does not keep.
  Measured (SmolLM2-135M's shape, one thread): the engine's start 52 s with an empty folder, 14 s
  with a filled one (eager: under a second). torch itself writes its default into the variable the
  first time it asks, so a value equal to that default is not taken for the user's.
- compilation_config.cache_dir = <folder>/vllm: vLLM's own compiled artifacts where its compilation
  mode writes them there (VLLM_COMPILE, the GPU's).
- VLLM_USE_AOT_COMPILE = 0 without a GPU: vLLM 0.25 and 0.32 save an ahead-of-time artifact of the
  model on CPU that they cannot load back ("'function' object has no attribute 'finalize_loading'":
  every start compiled again, 43-56 s); vLLM had turned it off on CPU for that reason
  (vllm-project/vllm#32037), and these releases turn it on again for every platform.
An eager engine changes nothing. One process's engines share the folder: the cache is keyed by
what is compiled.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, MutableMapping, Optional

INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
AOT_COMPILE = "VLLM_USE_AOT_COMPILE"


def _torch_default() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def prepare(folder: str, *, gpu: bool, environ: Optional[MutableMapping[str, str]] = None) -> Dict:
    """Set the variables above in `environ` (default os.environ) for a compiling engine and return
    the LLM keywords to add ({} without a folder)."""
    if not folder:
        return {}
    environ = os.environ if environ is None else environ
    root = Path(folder).resolve()
    current = environ.get(INDUCTOR_CACHE)
    if current is None or os.path.abspath(current) == _torch_default():
        environ[INDUCTOR_CACHE] = str(root / "inductor")
    if not gpu:
        environ.setdefault(AOT_COMPILE, "0")
    return {"compilation_config": {"cache_dir": str(root / "vllm")}}
