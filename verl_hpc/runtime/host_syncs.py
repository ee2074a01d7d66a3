"""Host synchronisations on a step's path, counted by kind and by where they happen.

    with HostSyncs() as syncs:
        engine.train_step(batch, loss_fn)
    syncs.counts()        # {"item": 1, "tolist": 1, "synchronize": 0, "blocking_copy": 0, "tensor_on_device": 0}
    syncs.sites()         # {"verl_hpc/engines/outputs.py:77 tolist": 1, ...}

Why: on a GPU the host queues kernels ahead of the device; every read of a device value on the host
(and every blocking copy) makes the host wait until the queue has drained, and the device idles
while the host then launches the next kernels. A step should read the host once, where its
metrics and its guard need the values, not per micro-batch or per parameter.

It spies on the Python entry points, so it counts on a CPU too, where nothing waits (the CPU tests
and the GPU benchmark's rehearsal), and on a GPU beside `torch.cuda.set_sync_debug_mode`
(`cuda_sync_warnings`), which sees what the spies cannot (a boolean mask's nonzero):
- item: Tensor.item, float(), int(), bool() of a tensor (on a GPU machine: of a device tensor; on
  a CPU every tensor counts, as the value a GPU would hold);
- tolist: Tensor.tolist (the same);
- synchronize: runtime.device.synchronize and torch.cuda.synchronize;
- blocking_copy: Tensor.to / Tensor.cuda naming a device without non_blocking (a copy from host
  memory is a stream synchronisation in torch's copy; on a CPU the same call is counted, as the
  copy a GPU would make);
- tensor_on_device: torch.tensor / torch.as_tensor of host data (not a tensor) with a device
  other than the CPU, or any device on a CPU (the same reasoning): a blocking host-to-device copy.
A site is the first frame of the project (verl_hpc/, benchmarks/) on the caller's stack.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import warnings
from typing import Dict, Iterator, List

import torch

KINDS = ("item", "tolist", "synchronize", "blocking_copy", "tensor_on_device")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN = ("verl_hpc" + os.sep, "benchmarks" + os.sep, "tests" + os.sep)


def _site() -> str:
    """path:line of the first project frame above the spy (the spy's own module excluded)."""
    f = sys._getframe(2)
    first = None
    while f is not None:
        path = f.f_code.co_filename
        if path != __file__:
            rel = os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else path
            if rel.startswith(_OWN):
                return f"{rel}:{f.f_lineno}"
            first = first or f"{rel}:{f.f_lineno}"
        f = f.f_back
    return first or "?"


def _names_a_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, int)) and not isinstance(a, bool)
               or isinstance(a, str) for a in args[:1])


class HostSyncs:
    def __init__(self):
        self.events: List[tuple] = []  # (kind, site)
        self._stack = contextlib.ExitStack()
        self._busy = False  # a spy's own calls (torch.tensor inside .to) are not counted twice

    def _note(self, kind: str) -> None:
        self.events.append((kind, _site()))

    def _spy(self, owner, name: str, kind, when=None):
        real = getattr(owner, name)
        rec = self

        def spy(*args, **kwargs):
            if not rec._busy and (when is None or when(args, kwargs)):
                rec._note(kind)
            rec._busy, was = True, rec._busy
            try:
                return real(*args, **kwargs)
            finally:
                rec._busy = was

        setattr(owner, name, spy)
        self._stack.callback(setattr, owner, name, real)

    def __enter__(self) -> "HostSyncs":
        import verl_hpc.runtime.device as device_mod

        on_cpu = not device_mod.has_gpu()

        def on_device(args, kwargs):  # a host tensor's value is no sync (on a CPU: every tensor counts)
            return on_cpu or args[0].device.type != "cpu"

        for name in ("item", "__float__", "__int__", "__bool__"):
            self._spy(torch.Tensor, name, "item", on_device)
        self._spy(torch.Tensor, "tolist", "tolist", on_device)
        self._spy(device_mod, "synchronize", "synchronize")
        if hasattr(torch, "cuda"):
            self._spy(torch.cuda, "synchronize", "synchronize")

        def blocking_to(args, kwargs):
            t, rest = args[0], args[1:]
            if not _names_a_device(rest, kwargs) or kwargs.get("non_blocking") or (len(rest) > 2 and rest[2] is True):
                return False
            dev = kwargs.get("device", rest[0] if rest else None)
            try:
                target = torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
            except (TypeError, RuntimeError):
                return False
            return on_cpu or target.type != t.device.type

        def host_data_to_device(args, kwargs):
            dev = kwargs.get("device")
            if dev is None or (args and isinstance(args[0], torch.Tensor)):
                return False
            return on_cpu or torch.device(dev).type != "cpu"

        self._spy(torch.Tensor, "to", "blocking_copy", blocking_to)
        self._spy(torch.Tensor, "cuda", "blocking_copy", lambda a, k: not k.get("non_blocking"))
        self._spy(torch, "tensor", "tensor_on_device", host_data_to_device)
        self._spy(torch, "as_tensor", "tensor_on_device", host_data_to_device)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def counts(self) -> Dict[str, int]:
        c = collections.Counter(kind for kind, _ in self.events)
        return {k: c.get(k, 0) for k in KINDS}

    def sites(self) -> Dict[str, int]:
        return dict(collections.Counter(f"{site} {kind}" for kind, site in self.events).most_common())

    def at(self, fragment: str) -> List[tuple]:
        """The events whose site contains `fragment` (a file name, or file:line)."""
        return [e for e in self.events if fragment in e[1]]


@contextlib.contextmanager
def cuda_sync_warnings() -> Iterator[Dict[str, int]]:
    """torch's own count on a GPU: `torch.cuda.set_sync_debug_mode("warn")` warns at every
    synchronising CUDA call; the warnings are caught and counted by the Python line that made the
    call ({} on a machine without CUDA, where nothing synchronises)."""
    counts: Dict[str, int] = {}
    from verl_hpc.runtime.device import has_gpu

    if not has_gpu():
        yield counts
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode(before)
    for w in caught:
        if "synchroniz" in str(w.message):
            path = w.filename
            rel = os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else path
            key = f"{rel}:{w.lineno}"
            counts[key] = counts.get(key, 0) + 1
