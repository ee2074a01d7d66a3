"""A rank's start-up imports with Python's garbage collector off, then the heap frozen.

Importing torch, transformers, Megatron-Core and vLLM leaves about a million long-lived objects.
With the collector on, each import's allocations set off collections that walk the growing heap
again and again, and every full collection later (vLLM asks for five while it builds an engine and
shuts it down) walks all of it once more. So a rank imports the libraries its role will use with the
collector off (`without_gc`), collects once, and freezes what is left (`gc.freeze()`, made for
objects that live as long as the process: the collector no longer walks them; they are still freed
when their last reference goes). Measured on a 2-core machine, a colocated rank's imports took
0.92x the CPU of the same imports with the collector on, about 0.9 CPU-s less a rank
(benchmarks/bench_startup.py; docs/speed.md, "A rank's start-up").

The collector is off only for these imports: a library this rank does not preload (a reward
function's, `rollout.engine=auto`'s choice) imports as before, with the collector on. A preload that
fails to import is left to the code that needs it, which raises its own error.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import logging
from typing import Iterator, List

log = logging.getLogger(__name__)

TOKENIZER = ["transformers.models.auto.tokenization_auto"]  # AutoTokenizer: every model role's tokenizer
HF_MODELS = ["transformers.modeling_utils", "transformers.models.auto.modeling_auto"]
MEGATRON = ["megatron.core", "megatron.core.models.gpt", "megatron.core.pipeline_parallel",
            "megatron.core.distributed", "megatron.core.optimizer"]
FSDP = ["torch.distributed.fsdp", *HF_MODELS]
VLLM = ["vllm", "vllm.entrypoints.llm"]  # the LLM class, which imports the engine


@contextlib.contextmanager
def without_gc() -> Iterator[None]:
    """The collector off inside; at the end one collection, the survivors frozen, and the
    collector back as it was (a job run inside another program, as the tests do, leaves it so)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        freeze_heap()
        if was_on:
            gc.enable()


def freeze_heap() -> None:
    """One collection, then what survives frozen until the process exits (the test suite also
    calls it before each test)."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache  # registered once, however many freezes a process runs (the tests run many)
def _unfreeze_at_exit() -> None:
    # Frozen objects are left out of the collection Python runs as it exits, so extension modules
    # that count their objects at exit (triton's nanobind bindings, imported with torch) print
    # "leaked ..." lines on stderr under the job's own last line: the heap goes back first.
    atexit.register(gc.unfreeze)


def modules_for(cfg, role: str) -> List[str]:
    """The modules the rank's `role` (both | train | rollout, RankContext.role) builds its engines
    with, for the config's engines. Only what the role will import anyway: a split job's rollout
    ranks never import Megatron-Core, its training ranks never import vLLM."""
    if cfg.trainer.job == "smoke":  # torch only, imported by the runtime already
        return []
    mods = list(TOKENIZER)
    if role in ("both", "train"):  # parallel.engine=auto decides per role's model folder: not guessed here
        mods += {"megatron": MEGATRON, "fsdp": FSDP}.get(cfg.parallel.engine, [])
    if role in ("both", "rollout") and cfg.trainer.job == "rl":
        if cfg.rollout.engine == "vllm":  # `auto` may choose HF generate: not guessed here
            mods += VLLM
        elif cfg.rollout.engine == "hf":
            mods += HF_MODELS
    return list(dict.fromkeys(mods))


def preload(cfg, role: str) -> List[str]:
    """Import modules_for(cfg, role); returns those imported. Call inside `without_gc`."""
    done = []
    for name in modules_for(cfg, role):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - the engine that needs it imports it again and says why
            log.debug("start-up import of %s skipped: %s", name, err)
            continue
        done.append(name)
    return done
