"""The diagnostics benchmarks/bench_gpu_step.py records per side, beside its timings (issue 85): what
a GPU run needs to tell which of the step's parts costs what, in the same call.

- `kernel_profile(fn)`: one warm step under torch's profiler. On a GPU its CUDA kernels: time by
  kernel (the top ones), the device's busy and idle time over the step, its largest idle gaps
  (with the kernels on either side), and the idle time of the optimizer phase (from where the
  engines' guarded_step starts, `OPTIMIZER_RANGE`, to the step's last kernel: the host reads and
  launches there leave the device waiting). On a CPU the same fields from the outermost aten
  operators (the rehearsal writes every column; its figures are no claim).
- `sync_counts(fn)`: one warm step under runtime/host_syncs.py's recorder (counts by kind, the
  lines that made them) and, on a GPU, torch.cuda.set_sync_debug_mode's warnings by line.
- `output_layer_read(side)`: how the output layer scored the last micro-batch and the free memory
  it read (the engines' heads record both), taken after steps 1, 2 and 3. The rehearsal pretends
  a device's free memory (`pretend_device_memory`), so that the device rule runs there too.
- `attention_costs(shape, device, dtype)`: the cost of one (query, key) pair of causal SDPA (the
  plain layout: flash where it runs) and of dense-masked SDPA (the FSDP engine's packed rows),
  each over one token's linear-layer work at the bench's shape: the two pair weights prompt
  sharing's cost model (engines/prefix.py, engines/fsdp/sharing.py) takes as one, calibrated on a
  CPU (mask penalty 5).
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List

import torch

OPTIMIZER_RANGE = "bench:optimizer_phase"
TOP_KERNELS = 12


@contextlib.contextmanager
def optimizer_ranges():
    """The engines' guarded_step (and the transformers sides' clip + step, which mark themselves)
    inside a profiler range named OPTIMIZER_RANGE, for kernel_profile to find."""
    import verl_hpc.engines.fsdp.optim as fsdp_optim

    patched = []
    try:
        import verl_hpc.engines.megatron.optim as megatron_optim
        modules = (fsdp_optim, megatron_optim)
    except ImportError:  # no megatron-core: the FSDP sides alone
        modules = (fsdp_optim,)
    for mod in modules:
        real = mod.guarded_step

        def marked(*args, _real=real, **kwargs):
            with torch.profiler.record_function(OPTIMIZER_RANGE):
                return _real(*args, **kwargs)

        mod.guarded_step = marked
        patched.append((mod, real))
    try:
        yield
    finally:
        for mod, real in patched:
            mod.guarded_step = real


def kernel_profile(fn, on_gpu: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with optimizer_ranges(), profile(activities=acts) as prof:
        fn()
    events = list(prof.events())
    cpu = torch.autograd.DeviceType.CPU
    marks = [e for e in events if e.name == OPTIMIZER_RANGE and e.device_type == cpu]
    opt_start = min((e.time_range.start for e in marks), default=None)
    if on_gpu:  # kernels, copies and fills on the device; not the ranges' device-side annotations
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False)]
    else:  # the rehearsal: the outermost aten operators (at any depth of annotated ranges) stand in
        kernels = [e for e in events if e.name.startswith("aten::") and not _inside_aten(e)]
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    out = {"unit": "CUDA kernels" if on_gpu else "CPU operators (rehearsal: no claim)",
           "kernels": len(spans), "top": _top(spans)}
    out.update(_idle(spans))
    out["optimizer_phase"] = _phase_idle(spans, opt_start) if opt_start is not None else None
    return out


def _inside_aten(event) -> bool:
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def _top(spans) -> List[dict]:
    by: Dict[str, list] = {}
    for a, b, name in spans:
        rec = by.setdefault(name, [0.0, 0])
        rec[0] += (b - a) / 1e3
        rec[1] += 1
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return [{"name": n[:120], "ms": round(ms, 3), "count": c} for n, (ms, c) in ranked]


def _idle(spans) -> dict:
    """Busy (the union of the intervals) and idle time over the step, and the largest gaps."""
    if not spans:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    busy, gaps, end, prev = 0.0, [], spans[0][0], spans[0][2]
    for a, b, name in spans:
        if a > end:
            gaps.append({"ms": round((a - end) / 1e3, 3), "after": prev[:80], "before": name[:80]})
        if b > end:
            busy += b - max(a, end)
            end, prev = b, name
    span = (end - spans[0][0]) / 1e3
    gaps.sort(key=lambda g: -g["ms"])
    return {"span_ms": round(span, 3), "busy_ms": round(busy / 1e3, 3), "idle_ms": round(span - busy / 1e3, 3),
            "gaps": gaps[:3]}


def _phase_idle(spans, start_us: float) -> dict:
    """From the end of the last kernel that started before the optimizer phase's host range began
    (the backward's tail) to the step's last kernel: how long, and how much of it idle."""
    before = [b for a, b, _ in spans if a < start_us]
    after = [(a, b, n) for a, b, n in spans if a >= start_us]
    if not after:
        return {"ms": 0.0, "idle_ms": 0.0, "first_kernel": None}
    t0 = max(before) if before else after[0][0]
    window = [(max(a, t0), b, n) for a, b, n in after if b > t0]
    idle = _idle([(t0, t0, "start")] + window)
    return {"ms": idle["span_ms"], "idle_ms": idle["idle_ms"], "first_kernel": after[0][2][:80],
            "gap_to_first_kernel_ms": round(max(after[0][0] - t0, 0.0) / 1e3, 3)}


def sync_counts(fn) -> dict:
    from verl_hpc.runtime.host_syncs import HostSyncs, cuda_sync_warnings

    with cuda_sync_warnings() as cuda, HostSyncs() as spies:
        fn()
    sites = spies.sites()
    return {"recorded": spies.counts(), "recorded_sites": dict(list(sites.items())[:10]),
            "cuda_sync_debug": dict(sorted(cuda.items(), key=lambda kv: -kv[1])[:10]) if cuda else None,
            "cuda_sync_debug_total": sum(cuda.values()) if cuda else None}


def output_layer_read(side) -> dict:
    """The engine's head's last decision and what it read (None for the transformers sides)."""
    eng = getattr(side, "engine", None)
    head = None if eng is None else (getattr(eng, "_head", None) or getattr(eng, "_chunked", None))
    if head is None:
        return {"path": None, "free_bytes": None, "pending_bytes": None}
    read = getattr(head, "free_read", None) or (None, None)
    return {"path": getattr(head, "last", None), "free_bytes": read[0], "pending_bytes": read[1]}


def attention_costs(shape, device, dtype, iters: int = 3) -> dict:
    """Per (query, key) pair: causal SDPA (half the pairs counted) and SDPA with a dense boolean mask
    (every pair), each over one token's linear-layer work (the GEMMs of one token through one layer),
    on [seqs, heads, seq, head_dim] of the bench's shape: the measured pair weights of the plain and
    the packed layout, beside the cost model's one (5 x 4h / linear)."""
    import torch.nn.functional as F

    from verl_hpc.runtime.device import synchronize

    s, b, h, d = shape.seq, shape.seqs, shape.heads, shape.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g, device=device).to(dtype) for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    kv = shape.kv_heads * d

    def rand(*size):
        return (0.02 * torch.randn(*size, generator=g, device=device)).to(dtype)

    n = b * s  # one layer's GEMMs on every token: q/k/v, the attention's output, gate, up, down
    gemms = [(rand(n, shape.hidden), rand(shape.hidden, h * d + 2 * kv)),
             (rand(n, h * d), rand(h * d, shape.hidden)),
             (rand(n, shape.hidden), rand(shape.hidden, 2 * shape.ffn)),
             (rand(n, shape.ffn), rand(shape.ffn, shape.hidden))]

    def linear():
        for a, w in gemms:
            a @ w

    def timed(fn):
        fn()
        synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        synchronize()
        return (time.perf_counter() - t) / iters

    with torch.no_grad():
        causal = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        dense = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        lin = timed(linear)
    per_token = lin / (b * s)
    pairs = b * s * s
    h_model = shape.hidden
    linear_flops = 2 * (h_model * (h * d + 2 * kv) + h * d * h_model + 3 * h_model * shape.ffn)
    return {"shape": [b, h, s, d], "causal_s": causal, "dense_mask_s": dense, "linear_s": lin,
            "pair_weight_causal": causal / (pairs / 2) / per_token,
            "pair_weight_dense_mask": dense / pairs / per_token,
            "pair_weight_cost_model": 5.0 * 4 * h * d / linear_flops}


@contextlib.contextmanager
def pretend_device_memory(free_bytes: int):
    """The output layer's device rule on a CPU: device_free_bytes answers `free_bytes` (on a CPU it
    answers None, and the engines keep the CPU's fixed chunk budget), so that a rehearsal runs the
    rule and its Adam reserve as a GPU run does."""
    import verl_hpc.engines.fsdp.head as head_mod
    import verl_hpc.engines.logits as logits_mod

    real = (head_mod.device_free_bytes, logits_mod.device_free_bytes)
    head_mod.device_free_bytes = logits_mod.device_free_bytes = lambda device: float(free_bytes)
    try:
        yield
    finally:
        head_mod.device_free_bytes, logits_mod.device_free_bytes = real
