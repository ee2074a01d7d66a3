"""CPU help for megatron-core 0.16.1: the one place that bends Megatron to run without a GPU.

megatron-core hard-codes CUDA in a few places on the model and training paths
(docs/platform-notes.md, "megatron-core 0.16.1 on CPU", items 1-7, plus rotary's
`torch.cuda.current_device()`).
`apply()` replaces exactly those, on every rank, after `parallel_state.initialize_model_parallel`,
and only when `runtime.device.has_gpu()` is false; on a GPU machine it does nothing. It is
idempotent and records what it changed (`applied()`).

Three kinds of replacement, narrowest that works for each target:
- RNG (item 2): megatron's tracker registry (`tensor_parallel.random._CUDA_RNG_STATE_TRACKER`, which
  `initialize_rng_tracker` respects once set) gets a `CpuRNGStatesTracker`: same add/fork
  semantics, CPU generator states. The module's two state helpers (`_get_cuda_rng_state`,
  `_set_cuda_rng_state`, used by activation recompute) are swapped for CPU ones.
- Allocation (items 1, 3-6, rotary): in each module listed in `TORCH_PROXY_MODULES` the module
  global `torch` becomes `_CpuTorch`, which forwards everything to torch except that a "cuda"
  device in a tensor factory means the CPU, and `torch.cuda.*` has CPU stand-ins (current device
  = cpu, synchronize/streams = no-ops). The real `torch` module is untouched.
- Tensor.cuda() calls (tied embeddings across pipeline stages): the methods in
  `SCOPED_TENSOR_CUDA` run with `Tensor.cuda` answering the tensor itself, for their duration only.
- Functions (`CPU_FUNCTIONS`): a module global replaced where the CPU needs different behaviour
  (MoE's host copy of split sizes, which is a no-op on CPU but must still give a sequence).
- Type-name checks (item 7): `param.type() == 'torch.cuda.FloatTensor'` in the functions of
  `TYPE_NAME_FUNCTIONS`; their code objects get the CPU type names as constants. Nothing else in
  those functions changes.

tests/unit/models/test_mdl_cpu_compat.py pins every CUDA touch point of these modules: when a new
megatron-core release moves one, that test names it; re-check it here before updating the pin.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import types
from typing import Any, Dict, List, Tuple

import torch

from verl_hpc.runtime.device import has_gpu

log = logging.getLogger(__name__)

VERIFIED_MEGATRON_VERSION = "0.16.1"

# module -> why it needs CPU allocation (item numbers of docs/platform-notes.md)
TORCH_PROXY_MODULES: Dict[str, str] = {
    "megatron.core.utils": "1: GlobalMemoryBuffer.get_tensor; 6: local_multi_tensor_l2_norm",
    "megatron.core.pipeline_parallel.schedules": "3: torch.zeros(device='cuda') token counters",
    "megatron.core.pipeline_parallel.p2p_communication": "4: receive buffers, cuda.synchronize",
    "megatron.core.distributed.param_and_grad_buffer": "5: param/grad buffers on CUDA",
    "megatron.core.distributed.distributed_data_parallel": "5: streams, synchronize",
    "megatron.core.optimizer.optimizer": "6: found_inf / loss-scale tensors on CUDA",
    "megatron.core.optimizer.clip_grads": "6: grad-norm tensors on CUDA",
    # fp16 training (model.dtype = float16): the dynamic loss scaler's scale and bounds
    "megatron.core.optimizer.grad_scaler": "fp16: loss-scale tensors on CUDA",
    "megatron.core.optimizer.distrib_optimizer": "7: shard buffers on CUDA",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "rotary inv_freq to CUDA",
    # DeepSeek-V3's YaRN (models/deepseek.py): its tables built on, and moved to, the current device
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "YaRN inv_freq to CUDA",
    # Found while building verl_hpc.models (the "found later" paragraph of the same section):
    "megatron.core.transformer.utils": "get_default_causal_mask (attention_mask=None) on CUDA",
    "megatron.core.tensor_parallel.mappings": "gather/scatter outputs (full-vocab logits) on CUDA",
    "megatron.core.tensor_parallel.utils": "1-D split/gather buffers (recompute) on CUDA",
    # Mixture-of-experts layers (models/moe.py): the alltoall dispatcher's device-to-host stream and
    # event, the router's weight moved to the current device, expert and aux-loss tensors on CUDA
    "megatron.core.transformer.moe.token_dispatcher": "MoE: dtoh stream, its event, streams compared",
    "megatron.core.transformer.moe.router": "MoE: router weight to the current device, aux-loss buffers",
    "megatron.core.transformer.moe.moe_utils": "MoE: aux-loss tracker values on CUDA, record_stream",
    "megatron.core.transformer.moe.experts": "MoE: expert weights on the current device",
    "megatron.core.transformer.moe.shared_experts": "MoE: the shared expert's overlap stream",
}
# Not proxied, on purpose: tensor_parallel.layers (its CUDA uses sit behind GPU-only options:
# use_cpu_initialization=False, sequence_parallel, gradient_accumulation_fusion) and
# tensor_parallel.data.broadcast_data (calls Tensor.cuda(); the engine batches without it).

# "module:Class.method" run with Tensor.cuda() returning the tensor itself (CPU): they call
# `.cuda()` on a tensor, which no module-level replacement can reach.
SCOPED_TENSOR_CUDA: Dict[str, str] = {
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.setup_embeddings_and_output_layer":
        "tied embeddings with pp > 1: weight.data.cuda() before the embedding all-reduce",
    "megatron.core.optimizer.grad_scaler:DynamicGradScaler.load_state_dict":
        "fp16: a resumed loss scale is moved with .cuda() (the engine's checkpoint, state.py)",
}

# "module:Qualified.name" -> number of 'torch.cuda.*Tensor' constants replaced (checked at apply)
TYPE_NAME_FUNCTIONS: Dict[str, int] = {
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32": 1,
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups": 2,
    # bf16/fp16 without the distributed optimizer (one data-parallel rank): the fp32 master copies
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__": 2,
}
# "module:function" -> (its CPU replacement's name in this module, why): module globals replaced where
# a function's CPU behaviour differs in kind, not in placement
CPU_FUNCTIONS: Dict[str, Tuple[str, str]] = {
    "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu": (
        "_host_copy", "MoE: split sizes stay tensors on CPU; all_to_all_single wants a sequence"),
}
CPU_TYPE_NAMES = {f"torch.cuda.{t}Tensor": f"torch.{t}Tensor" for t in ("Float", "Half", "BFloat16")}

RNG_MODULE = "megatron.core.tensor_parallel.random"

# torch factories whose `device=` (or autocast's device_type) may name "cuda" in those modules
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "empty_like",
              "zeros_like", "ones_like", "full_like", "rand", "randn", "randint", "autocast")
# torch.cuda attributes that are harmless to forward on a CPU build (they answer "no GPU")
_CUDA_FORWARDED = ("is_available", "device_count", "nvtx", "is_current_stream_capturing")


@dataclasses.dataclass(frozen=True)
class PatchRecord:
    target: str  # what was replaced: "module:attribute"
    kind: str  # rng-tracker | rng-state-helper | module-torch | scoped-tensor-cuda | type-names | function
    why: str


_applied: List[PatchRecord] = []
_originals: Dict[str, Tuple[str, Any]] = {}  # target -> (kind, original), for revert() in tests


def applied() -> Tuple[PatchRecord, ...]:
    """What `apply()` replaced in this process (empty on GPU machines or before apply)."""
    return tuple(_applied)


def _cpu(device):
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal, as torch.cuda.current_device() would return on a GPU
    return device


class _NoStream:
    """A CUDA stream (and event) stand-in: work on the CPU is already ordered, so every stream is
    the one stream (equal to each other: code that asks "am I on a side stream?" hears no), and an
    event recorded on it is itself, already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    synchronize = wait_event = wait_stream

    def record_event(self, *args, **kwargs):
        return self

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    def __hash__(self):
        return 0


class _CpuCuda:
    """`torch.cuda` as seen from a proxied megatron module on a machine without a GPU."""

    Stream = _NoStream
    current_device = staticmethod(lambda: torch.device("cpu"))
    synchronize = empty_cache = staticmethod(lambda *args, **kwargs: None)
    stream = staticmethod(lambda stream=None: contextlib.nullcontext())
    default_stream = current_stream = staticmethod(lambda *args, **kwargs: _NoStream())

    def __getattr__(self, name):
        if name in _CUDA_FORWARDED:
            return getattr(torch.cuda, name)
        # Loud on purpose: a new CUDA use in megatron must be looked at, not silently forwarded.
        raise AttributeError(
            f"verl_hpc.parallel.cpu_compat: megatron-core used torch.cuda.{name}, which has no CPU "
            f"stand-in; add one in verl_hpc/parallel/cpu_compat.py after checking what it does")


class _CpuTorch(types.ModuleType):
    """The `torch` module as seen from a proxied megatron module: CUDA placements become CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        real = getattr(torch, name)
        if name not in _FACTORIES:
            return real

        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            if name == "autocast":
                if args:
                    args = (_cpu(args[0]),) + args[1:]
                if "device_type" in kwargs:
                    kwargs["device_type"] = _cpu(kwargs["device_type"])
            return real(*args, **kwargs)

        factory.__name__ = name
        return factory


class CpuRNGStatesTracker:
    """Named RNG states on the CPU generator, with `CudaRNGStatesTracker`'s semantics: `add` makes
    a state from a seed without disturbing the current one; `fork(name)` runs a block on that
    state, saves where it got to, and restores the previous state. Created as a subclass of
    megatron's class in `_tracker_class()` so that megatron's isinstance checks still hold."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer = self.states_[outer_name]
            torch.set_rng_state(outer)
            self._current_state_name = outer_name


def _tracker_class():
    rnd = importlib.import_module(RNG_MODULE)
    cls = getattr(rnd, "_VerlHpcCpuRNGStatesTracker", None)
    if cls is None:
        cls = type("CpuRNGStatesTracker", (CpuRNGStatesTracker, rnd.CudaRNGStatesTracker), {})
        rnd._VerlHpcCpuRNGStatesTracker = cls
    return cls


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _remember(target: str, original, kind: str, why: str = "") -> None:
    _originals.setdefault(target, (kind, original))
    if why:
        _applied.append(PatchRecord(target, kind, why))


def _patch_rng() -> None:
    rnd = importlib.import_module(RNG_MODULE)
    cls = _tracker_class()
    current = rnd._CUDA_RNG_STATE_TRACKER
    if current is not None and not isinstance(current, cls) and current.get_states():
        raise RuntimeError("cpu_compat.apply(): megatron's CUDA RNG tracker already holds states; "
                           "apply before model_parallel_cuda_manual_seed")
    _remember(f"{RNG_MODULE}:_CUDA_RNG_STATE_TRACKER", current, "rng-tracker",
              "2: CudaRNGStatesTracker.add/fork use the CUDA generator")
    # initialize_rng_tracker() returns early once this flag is set, so megatron keeps ours.
    _remember(f"{RNG_MODULE}:_CUDA_RNG_STATE_TRACKER_INITIALIZED",
              rnd._CUDA_RNG_STATE_TRACKER_INITIALIZED, "rng-tracker")
    rnd._CUDA_RNG_STATE_TRACKER = cls()
    rnd._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    for attr, repl in (("_get_cuda_rng_state", _cpu_get_rng_state),
                       ("_set_cuda_rng_state", _cpu_set_rng_state)):
        _remember(f"{RNG_MODULE}:{attr}", getattr(rnd, attr), "rng-state-helper",
                  "2: activation recompute saves/restores the CUDA generator state")
        setattr(rnd, attr, repl)


def _patch_torch_globals() -> None:
    proxy = _CpuTorch()
    for name, why in TORCH_PROXY_MODULES.items():
        module = importlib.import_module(name)
        if module.__dict__.get("torch") is not torch:
            raise RuntimeError(f"cpu_compat: {name}.torch is not the torch module; re-check it")
        _remember(f"{name}:torch", torch, "module-torch", why)
        module.torch = proxy


def _retarget_consts(code: types.CodeType) -> Tuple[types.CodeType, int]:
    """Return `code` with CUDA tensor type names replaced by CPU ones (nested code included)."""
    count, consts = 0, []
    for c in code.co_consts:
        if isinstance(c, str) and c in CPU_TYPE_NAMES:
            c, count = CPU_TYPE_NAMES[c], count + 1
        elif isinstance(c, tuple) and any(x in CPU_TYPE_NAMES for x in c if isinstance(x, str)):
            c = tuple(CPU_TYPE_NAMES.get(x, x) if isinstance(x, str) else x for x in c)
            count += 1
        elif isinstance(c, types.CodeType):
            c, n = _retarget_consts(c)
            count += n
        consts.append(c)
    return code.replace(co_consts=tuple(consts)), count


def _owner(target: str):
    """'module:Class.attr' or 'module:attr' -> (the object holding attr, attr)."""
    module_name, qualname = target.split(":")
    *path, attr = qualname.split(".")
    obj = importlib.import_module(module_name)
    for part in path:
        obj = getattr(obj, part)
    return obj, attr


def resolve_function(target: str):
    """'module:Class.method' -> the plain function object (unwrapping classmethod/staticmethod)."""
    obj, attr = _owner(target)
    fn = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
    return getattr(fn, "__func__", fn)


def _patch_type_names() -> None:
    for target, expected in TYPE_NAME_FUNCTIONS.items():
        fn = resolve_function(target)
        new_code, count = _retarget_consts(fn.__code__)
        if count != expected:
            raise RuntimeError(
                f"cpu_compat: {target} has {count} CUDA tensor-type constants, expected {expected}; "
                f"megatron-core changed, re-check item 7 of docs/platform-notes.md against it")
        _remember(target, fn.__code__, "type-names", "7: rejects non-'torch.cuda.*Tensor' params")
        fn.__code__ = new_code


def _tensor_itself(self, *args, **kwargs):
    return self


def _with_cpu_tensor_cuda(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = _tensor_itself  # model construction is single-threaded
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = saved

    return wrapper


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's `maybe_move_tensor_to_cpu` on a machine without a GPU: the tensor is already on
    the host; only the numpy form the alltoall dispatcher asks for (its split sizes, which
    all_to_all_single takes as a sequence) is made."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _patch_functions() -> None:
    for target, (replacement, why) in CPU_FUNCTIONS.items():
        owner, attr = _owner(target)
        _remember(target, getattr(owner, attr), "function", why)
        setattr(owner, attr, globals()[replacement])


def _patch_scoped_tensor_cuda() -> None:
    for target, why in SCOPED_TENSOR_CUDA.items():
        cls, meth = _owner(target)
        original = cls.__dict__[meth]
        _remember(target, original, "scoped-tensor-cuda", why)
        setattr(cls, meth, _with_cpu_tensor_cuda(original))


def apply(force: bool = False) -> Tuple[PatchRecord, ...]:
    """Make megatron-core usable on this rank if it has no GPU; a no-op with a GPU. Idempotent.

    `force=True` applies even with a GPU present (tests only)."""
    if _applied or (has_gpu() and not force):
        return applied()
    import megatron.core

    if megatron.core.__version__ != VERIFIED_MEGATRON_VERSION:
        log.warning("cpu_compat was verified against megatron-core %s, found %s: run "
                    "tests/unit/models/test_mdl_cpu_compat.py", VERIFIED_MEGATRON_VERSION,
                    megatron.core.__version__)
    _patch_rng()
    _patch_torch_globals()
    _patch_scoped_tensor_cuda()
    _patch_type_names()
    _patch_functions()
    log.debug("cpu_compat applied %d replacements to megatron-core", len(_applied))
    return applied()


def revert() -> None:
    """Undo `apply()` (tests that compare patched and unpatched behaviour)."""
    for target, (kind, original) in _originals.items():
        if kind == "type-names":
            resolve_function(target).__code__ = original
        else:
            setattr(*_owner(target), original)
    _originals.clear()
    _applied.clear()
