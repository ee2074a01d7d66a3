"""`rollout.quantization` and `rollout.kv_cache_dtype` in the vLLM rollout (docs/quantization.md):
which methods the installed vLLM offers, which of them run on this machine, and the engine's
arguments.

vLLM quantizes the policy itself, online, on every weight load: the trainer sends what it sends
without quantization (full, sliced, delta, LoRA merged) and each reload quantizes the new tensors
(vLLM's layerwise reload resets its "already processed" flag per layer and runs the method again).
What the installed vLLM offers is read from vLLM (`vllm.config.quantization._ONLINE_SHORTHANDS`:
each method's linear and MoE specs), what runs here is asked of it by running it
(rollout/vllm/quant_probe.py, cached per vLLM version and machine); nothing is listed here, so a vLLM
upgrade changes the answers without a change to this file.

The online methods take bf16 or fp16 activations only ("torch.float32 is not supported for
quantization method ..."): a quantized CPU rollout runs in bfloat16 (an unquantized one in float32,
the exact-parity precision), a GPU one in model.dtype, which must be bf16 or fp16.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import typing
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from verl_hpc.config.errors import ConfigError

log = logging.getLogger(__name__)

NONE = "none"
FIELD, KV_FIELD = "rollout.quantization", "rollout.kv_cache_dtype"
PROBE_VERSION = 1
TIMEOUT_S = 900
_memo: Dict[str, dict] = {}


def offered() -> Dict[str, Tuple[bool, bool]]:
    """{method: (quantizes linear layers, quantizes MoE experts)}: the installed vLLM's online methods."""
    from vllm.config.quantization import _ONLINE_SHORTHANDS

    return {name: (args.linear is not None, args.moe is not None) for name, args in _ONLINE_SHORTHANDS.items()}


def quantizes_linear(method: str) -> bool:
    return method != NONE and offered().get(method, (False, False))[0]


def kv_cache_dtypes() -> Tuple[str, ...]:
    """The KV-cache dtypes the installed vLLM's config accepts."""
    from vllm.config.cache import CacheDType

    return tuple(typing.get_args(CacheDType))


def machine() -> str:
    """What a verdict holds for: the GPU's name, or the CPU's instruction-set flags (hashed)."""
    from verl_hpc.runtime.device import describe_accelerator, has_gpu

    if has_gpu():
        return f"cuda:{describe_accelerator()}"
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return "cpu:" + hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]


def _cache_file(key: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "verl_hpc" / "vllm_quant"
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def verdicts(asked: Iterable[Tuple[str, str]]) -> Dict[Tuple[str, str], Optional[str]]:
    """{(method, kv_cache_dtype): None where it runs here, else vLLM's reason}; those not yet known
    are asked of one probe subprocess (rollout/vllm/quant_probe.py)."""
    from verl_hpc.rollout.vllm.probe import vllm_distribution

    base = f"{PROBE_VERSION} {' '.join(vllm_distribution())} {machine()}"
    out, ask = {}, []
    for pair in dict.fromkeys(asked):
        key = f"{base} {pair[0]}:{pair[1]}"
        if key not in _memo:
            try:
                _memo[key] = json.loads(_cache_file(key).read_text())
            except (OSError, ValueError):
                ask.append(pair)
                continue
        out[pair] = _memo[key]["error"]
    for pair, verdict in zip(ask, _run(ask) if ask else []):
        key = f"{base} {pair[0]}:{pair[1]}"
        _memo[key] = verdict
        if "failed" not in verdict:
            _store(_cache_file(key), verdict)
        out[pair] = verdict["error"]
    return out


def _run(pairs) -> List[dict]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)  # the probe's engines must not take the job's rendezvous
    cmd = [sys.executable, "-m", "verl_hpc.rollout.vllm.quant_probe", *(f"{m}:{kv}" for m, kv in pairs)]
    why = None
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        lines = {x["asked"]: x for x in (json.loads(line) for line in proc.stdout.splitlines()
                                          if line.startswith('{"asked"'))}
        if len(lines) == len(pairs):
            return [{"error": lines[f"{m}:{kv}"]["error"]} for m, kv in pairs]
        why = f"the probe ended with exit code {proc.returncode}: {(proc.stderr.strip().splitlines() or ['-'])[-1]}"
    except subprocess.TimeoutExpired:
        why = f"the probe gave no answer within {TIMEOUT_S} s"
    log.warning("vLLM quantization probe: %s; the engine's own construction will say", why)
    return [{"error": None, "failed": why}] * len(pairs)  # undecided: not refused here


def _store(path: Path, verdict: dict) -> None:
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(verdict, f)
        os.replace(f.name, path)


def _experts(model_path: str) -> int:
    from verl_hpc.config.hf_model import read_model_shape

    try:
        return read_model_shape(model_path).experts
    except ConfigError:
        return 0  # model.path's own check reports the folder


def problems(method: str, kv_cache_dtype: str, model_path: str, *, here: bool) -> List[str]:
    """One line per setting the installed vLLM, the model or (`here`: this machine is the kind the
    job runs on) the device cannot take, each naming what would work here."""
    p = []
    kinds = offered()
    if method != NONE and method not in kinds:
        p.append(f"{FIELD} = {method}: the installed vLLM has no such online method; it offers "
                 f"{', '.join(sorted(kinds))} (or none)")
        method = NONE
    linear = {m for m, (lin, _) in kinds.items() if lin}
    moe = bool(model_path) and _experts(model_path) > 0
    if method != NONE and method not in linear and not moe:
        p.append(f"{FIELD} = {method} quantizes the experts of a mixture-of-experts model only, and model.path is "
                 f"dense: nothing would be quantized; methods that quantize linear layers: {', '.join(sorted(linear))}")
        method = NONE
    dtypes = kv_cache_dtypes()
    if kv_cache_dtype not in dtypes:
        p.append(f"{KV_FIELD} = {kv_cache_dtype}: the installed vLLM takes {', '.join(dtypes)}")
        kv_cache_dtype = "auto"
    if not here or (method == NONE and kv_cache_dtype == "auto"):
        return p
    candidates = sorted(m for m in kinds if (m in linear or moe) and m != method)
    found = verdicts([(method, kv_cache_dtype), (method, "auto"), *((m, "auto") for m in candidates)])
    runs = [m for m in candidates if found[(m, "auto")] is None]
    alternatives = f"methods that run here: {', '.join(runs) or 'none'}"
    if method != NONE and found[(method, "auto")] is not None:
        p.append(f"{FIELD} = {method} does not run on this machine ({found[(method, 'auto')]}); {alternatives}")
    elif found[(method, kv_cache_dtype)] is not None:
        p.append(f"{KV_FIELD} = {kv_cache_dtype} does not run on this machine ({found[(method, kv_cache_dtype)]}); "
                 "kv_cache_dtype = auto does")
    return p


def engine_args(method: str, kv_cache_dtype: str, dtype: str, gpu: bool) -> dict:
    """vllm.LLM's keywords for the settings: the method and the KV-cache dtype, and bfloat16
    activations on a CPU when quantized (the online methods take no float32)."""
    out = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    if method != NONE:
        out["quantization"] = method
        if not gpu:
            out["dtype"] = "bfloat16"
        elif dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"{FIELD} = {method} with model.dtype = {dtype}: vLLM's online quantization takes "
                              "bfloat16 or float16 activations; set model.dtype = bfloat16")
    return out


@contextlib.contextmanager
def construction(method: str, kv_cache_dtype: str, model_path: str):
    """Around vLLM's engine construction: a quantized engine vLLM cannot build here becomes one
    ConfigError naming the setting and what runs here (asked of the probe), not vLLM's traceback."""
    try:
        yield
    except (ValueError, RuntimeError, NotImplementedError) as e:
        if method == NONE and kv_cache_dtype == "auto":
            raise
        found = problems(method, kv_cache_dtype, model_path, here=True)
        raise ConfigError(found[0] if found else f"{FIELD} = {method}, {KV_FIELD} = {kv_cache_dtype}: vLLM "
                          f"could not build the engine ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
