"""The chunked output layer's elementwise work per chunk as pure functions that torch.compile fuses
(engines/logits.py `token_outputs(..., fused=True)`).

Why: at a large vocabulary the chunk loop's time is memory passes over `[chunk, V]`, not the matmul.
At V = 151,936 and hidden 1,024 a chunk's logits matmul is 2 x hidden = 2,048 FLOPs per logit; its
eager elementwise work (upcast, shift, exp, three sums, the backward's log p, p, the entropy and
target terms, the cast) reads and writes each fp32 logit about twenty times, 80 bytes or more, which
on an H100 (about 3 TB/s against about 800 dense bf16 TFLOP/s) costs more than the matmul. Fused,
the forward reads the logits twice (the max, then one pass for every sum) and the backward once.

The arithmetic is the eager path's, op for op (the upcast, the temperature, the shift by the max,
exp, the sums; d log p_t / dz = 1[v = t] - p, dH/dz = -p (log p + H)): only the kernels differ, so
the results agree to rounding. Whether it pays is a GPU measurement (benchmarks/bench_gpu_logits.py,
the `chunked_fused` path); until then the engines keep the eager body.

COMPILE = False runs the same functions eagerly (the CPU tests of the arithmetic).
"""
from __future__ import annotations

import functools

import torch

COMPILE = True
BACKEND = "inductor"  # torch.compile's backend (a test counts the graphs with a counting one)


def _compiled(fn):
    """fn compiled once per process, or fn itself where COMPILE is off."""
    if not COMPILE:
        return fn
    return _compile(fn)


@functools.cache
def _compile(fn):
    # dynamic=None (torch's automatic dynamic shapes): the first token count compiles a graph of
    # that size, the second a graph with the token dimension symbolic, which every later count
    # reuses. dynamic=False made three new graphs (max, sums, gradient) for every token count a
    # micro-batch brought, and after torch's recompile limit (8 per function) ran the chunk eagerly.
    return torch.compile(fn, dynamic=None, backend=BACKEND)


def _shifted(z: torch.Tensor, m: torch.Tensor, temperature: float) -> torch.Tensor:
    s = z.float()
    if temperature != 1.0:
        s = s / temperature
    return s - m.unsqueeze(-1)


def chunk_max_fn(z: torch.Tensor, temperature: float) -> torch.Tensor:
    s = z.float()
    if temperature != 1.0:
        s = s / temperature
    return s.amax(dim=-1)


def chunk_stats_fn(z: torch.Tensor, m: torch.Tensor, cols: torch.Tensor, mine: torch.Tensor, temperature: float,
                   with_spp: bool) -> torch.Tensor:
    """[c, 3 or 4]: sum exp(s), sum exp(s) s, the target's s (0 where this slice lacks it), sum exp(s)^2,
    with s = z / temperature - m: the eager forward's stacked sums."""
    s = _shifted(z, m, temperature)
    e = torch.exp(s)
    parts = [e.sum(dim=-1), (e * s).sum(dim=-1),
             torch.where(mine, s.gather(1, cols.unsqueeze(1)).squeeze(1), 0.0)]
    if with_spp:
        parts.append((e * e).sum(dim=-1))
    return torch.stack(parts, dim=-1)


def chunk_grad_fn(z: torch.Tensor, m: torch.Tensor, logz: torch.Tensor, ent: torch.Tensor, g_ent: torch.Tensor,
                  g_logp: torch.Tensor, cols: torch.Tensor, mine: torch.Tensor, temperature: float,
                  has_ent: bool, has_logp: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """The logits' gradient `[c, V_local]` in `out_dtype` (the weights'), as the eager backward."""
    logp = _shifted(z, m, temperature) - logz.unsqueeze(-1)
    p = torch.exp(logp)
    if has_ent:
        grad = (logp + ent.unsqueeze(-1)) * p * (-g_ent.unsqueeze(-1))
    else:
        grad = torch.zeros_like(p)
    if has_logp:
        gl = g_logp.unsqueeze(-1)
        grad = grad - p * gl
        grad = grad.scatter_add(1, cols.unsqueeze(1), torch.where(mine, g_logp, 0.0).unsqueeze(1))
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(out_dtype)


def chunk_max(*args):
    return _compiled(chunk_max_fn)(*args)


def chunk_stats(*args):
    return _compiled(chunk_stats_fn)(*args)


def chunk_grad(*args):
    return _compiled(chunk_grad_fn)(*args)
