"""The output layer's per-token results without the whole `[tokens, vocabulary]` logits.

    out = token_outputs(hidden, weight, targets, ("log_probs", "entropy"), temperature=0.7, chunk=256)

From the final hidden states `[..., h]` and the output weight `[V_local, h]` (the whole vocabulary,
or this rank's slice of it under tensor parallelism, `vocab_start` its first token id), each
token's log-prob of its target, the entropy of its distribution and sum_v p_v^2 (the optimal
token baseline's), all of softmax(hidden @ weight.T / temperature), in float32.

Why: an RL update scores every response token, and the logits of 8 x 4,096 tokens at a 151,936-token
vocabulary are 19.9 GB per fp32 copy; the log-softmax and the entropy each add another. Here the
tokens go through in chunks of `chunk`: each chunk's logits `[chunk, V_local]` live only while its
results are computed, and the backward (a custom autograd function) recomputes them from the saved
hidden states instead of keeping them. What is kept per token: the max, log Z and the entropy.

Tensor parallelism (`group`): a chunk's max and its stacked sums (sum exp, sum exp * s, sum exp^2,
the target's logit, which only the rank holding it has) are all-reduced over the group, two
collectives per chunk; the vocabulary is never gathered. The backward needs no communication: with
the global max and log Z each rank's share of the logits' gradient is local (d log p_t / dz_v =
1[v = t] - p_v; dH/dz_v = p_v (E_p[s] - s_v)). The hidden states' gradient is each rank's partial
sum over its slice: the caller's TP region mapping (Megatron's copy_to_tensor_model_parallel_region)
all-reduces it, exactly as the output layer's own backward does.

A padded vocabulary: pass only the real rows of the weight (the padded ones would be -inf logits,
which add exp(-inf) = 0 everywhere; slicing them off gives the same results and a zero gradient).

No host syncs inside the loops: every branch is on Python numbers (sizes, the temperature), never
on a tensor's value, so on a GPU the chunks are queued back to back.

How many tokens a chunk takes, and whether to chunk at all, is planning/output_layer.py's rule
(`output_chunk`); on a device the engines give it `device_free_bytes`, measured at the output layer.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

OUTPUTS = ("log_probs", "entropy", "sum_pi_squared")


def token_outputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, want: Sequence[str], *,
                  temperature: float = 1.0, chunk: int = 1024, group=None,
                  vocab_start: int = 0, fused: bool = False) -> Dict[str, torch.Tensor]:
    """{name: [...] float32} for `want` (a subset of OUTPUTS) of hidden `[..., h]`, targets `[...]`.
    log_probs and entropy are differentiable (in hidden and weight); sum_pi_squared is not.
    fused: each chunk's elementwise work through torch.compile'd functions (logits_fused.py; the
    same arithmetic in fewer memory passes), not yet the engines' default: a GPU measures it first."""
    unknown = set(want) - set(OUTPUTS)
    if unknown:
        raise ValueError(f"the output layer gives {OUTPUTS}; asked for {sorted(unknown)}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: "
                         "hidden must be targets' shape plus the hidden size")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"output weight {tuple(weight.shape)} must be [vocab, {hidden.shape[-1]}]")
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    lead = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, ent, spp = _ChunkedOutputs.apply(flat, weight, targets.reshape(-1), float(temperature), int(chunk),
                                           group, int(vocab_start), "sum_pi_squared" in want, bool(fused))
    every = {"log_probs": logp, "entropy": ent, "sum_pi_squared": spp}
    return {k: every[k].view(lead) for k in want}


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[c, V_local] in float32: the matmul in the weights' dtype (as the output layer runs it), then
    the upcast and the temperature, as the unchunked path applies them."""
    z = F.linear(h, weight).float()
    return z / temperature if temperature != 1.0 else z


def _target_columns(targets: torch.Tensor, vocab_start: int, width: int):
    """(column in this slice, whether this slice holds the target) per token."""
    local = targets - vocab_start
    mine = (local >= 0) & (local < width)
    return local.clamp(0, max(width - 1, 0)), mine


class _ChunkedOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, group, vocab_start, with_spp, fused):
        n, width = hidden.shape[0], weight.shape[0]
        fused = fused and width > 0
        dev = hidden.device
        m_all = torch.empty(n, dtype=torch.float32, device=dev)
        logz_all, logp_all, ent_all = torch.empty_like(m_all), torch.empty_like(m_all), torch.empty_like(m_all)
        spp_all = torch.empty_like(m_all)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            cols, mine = _target_columns(targets[a:b], vocab_start, width)
            if fused:
                from verl_hpc.engines import logits_fused

                z = F.linear(hidden[a:b], weight)
                m = _all_reduce(logits_fused.chunk_max(z, temperature), dist.ReduceOp.MAX, group)
                local = logits_fused.chunk_stats(z, m, cols, mine, temperature, with_spp)
                del z
            else:
                z = _chunk_logits(hidden[a:b], weight, temperature)
                m = z.amax(dim=-1) if width else torch.full((b - a,), float("-inf"), device=dev)
                m = _all_reduce(m, dist.ReduceOp.MAX, group)
                s = z.sub_(m.unsqueeze(-1))  # in place: z is not needed again
                e = torch.exp(s)
                parts = [e.sum(dim=-1), (e * s).sum(dim=-1),
                         torch.where(mine, s.gather(1, cols.unsqueeze(1)).squeeze(1), 0.0) if width
                         else torch.zeros_like(m)]
                if with_spp:
                    parts.append(e.square_().sum(dim=-1))  # e is not needed again either
                del s, e, z
                local = torch.stack(parts, dim=-1)
            stats = _all_reduce(local, dist.ReduceOp.SUM, group)
            z_sum = stats[:, 0]
            logz = torch.log(z_sum)
            m_all[a:b], logz_all[a:b] = m, logz
            logp_all[a:b] = stats[:, 2] - logz
            ent_all[a:b] = logz - stats[:, 1] / z_sum
            if with_spp:
                spp_all[a:b] = stats[:, 3] / (z_sum * z_sum)
        if not with_spp:
            spp_all.zero_()
        ctx.save_for_backward(hidden, weight, targets, m_all, logz_all, ent_all)
        ctx.temperature, ctx.chunk, ctx.vocab_start, ctx.fused = temperature, chunk, vocab_start, fused
        ctx.mark_non_differentiable(spp_all)
        return logp_all, ent_all, spp_all

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_spp):
        hidden, weight, targets, m_all, logz_all, ent_all = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        n, width = hidden.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_hidden = torch.empty_like(hidden) if need_h else None
        # the weight's gradient sums over every chunk: in float32 whatever the weights' dtype
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            h = hidden[a:b]
            if ctx.fused:
                grad = _fused_grad(ctx, h, weight, targets[a:b], m_all[a:b], logz_all[a:b], ent_all[a:b],
                                   None if g_ent is None else g_ent[a:b], None if g_logp is None else g_logp[a:b])
                _accumulate(grad, h, weight, g_hidden, g_weight, a, b)
                continue
            s = _chunk_logits(h, weight, t).sub_(m_all[a:b].unsqueeze(-1))
            p = torch.exp(s.sub_(logz_all[a:b].unsqueeze(-1)))  # s is now log p
            # d entropy / d z_v = p_v (E_p[log p] - log p_v) = -p_v (H + log p_v)
            if g_ent is not None:
                grad = s.add_(ent_all[a:b].unsqueeze(-1)).mul_(p).mul_(-g_ent[a:b].unsqueeze(-1))
            else:
                grad = torch.zeros_like(p)
            if g_logp is not None:  # d log p_t / d z_v = 1[v = t] - p_v
                gl = g_logp[a:b].unsqueeze(-1)
                grad.addcmul_(p, gl, value=-1.0)
                cols, mine = _target_columns(targets[a:b], ctx.vocab_start, width)
                # a scatter of 0 where this slice does not hold the target: no nonzero(), whose
                # output size would make the host wait for the device inside the loop
                grad.scatter_add_(1, cols.unsqueeze(1), torch.where(mine, gl.squeeze(-1), 0.0).unsqueeze(1))
            del p, s
            if t != 1.0:
                grad.div_(t)
            _accumulate(grad.to(weight.dtype), h, weight, g_hidden, g_weight, a, b)
        return (g_hidden, g_weight.to(weight.dtype) if need_w else None, None, None, None, None, None, None, None)


# The weight gradient's GEMM: "low" = its operands in the weights' dtype, accumulated into the fp32
# sum (torch.addmm's out_dtype, a bf16 tensor-core GEMM on a GPU); "fp32" = both operands upcast
# first (an fp32 GEMM: with TF32 off, as torch leaves it, a CUDA-core SGEMM at about a tenth of the
# bf16 rate). The results agree to summation order: a bf16 operand is exact in fp32. "fp32" is kept
# for benchmarks/bench_gpu_logits.py, which times both forms.
WEIGHT_GRAD_GEMM = "low"


def _accumulate(grad, h, weight, g_hidden, g_weight, a: int, b: int) -> None:
    """A chunk's logits gradient (the weights' dtype) into the hidden states' and the weight's."""
    if g_hidden is not None:
        g_hidden[a:b] = grad @ weight
    if g_weight is None:
        return
    low = grad.dtype in (torch.float16, torch.bfloat16) and h.dtype == grad.dtype
    if low and WEIGHT_GRAD_GEMM == "low" and low_precision_addmm(g_weight.device):
        torch.addmm(g_weight, grad.t(), h, out_dtype=torch.float32, out=g_weight)
    else:  # fp32 operands, or a device without the fp32-output kernel (the CPU): upcast first
        g_weight.addmm_(grad.t().float(), h.float())


@functools.cache
def low_precision_addmm(device: torch.device) -> bool:
    """Whether torch has a kernel for addmm with bf16/fp16 operands and an fp32 result accumulated in
    place on this kind of device (`aten::addmm.dtype_out`: CUDA in torch >= 2.8, not the CPU), and
    it takes an fp32 accumulator: tried once on tiny tensors (torch 2.8's first form wanted the
    accumulator in the operands' dtype)."""
    key = {"cuda": "CUDA", "meta": "Meta", "cpu": "CPU"}.get(device.type)
    if key is None or not torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", key):
        return False
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
    ops = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    try:
        torch.addmm(acc, ops, ops, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _fused_grad(ctx, h, weight, targets, m, logz, ent, g_ent, g_logp) -> torch.Tensor:
    from verl_hpc.engines import logits_fused

    cols, mine = _target_columns(targets, ctx.vocab_start, weight.shape[0])
    return logits_fused.chunk_grad(F.linear(h, weight), m, logz, ent, m if g_ent is None else g_ent,
                                   m if g_logp is None else g_logp, cols, mine, ctx.temperature,
                                   g_ent is not None, g_logp is not None, weight.dtype)


def device_free_bytes(device: torch.device) -> Optional[float]:
    """Bytes a tensor allocated now on `device` could take (runtime.device.free_memory_bytes: the
    driver's free memory plus what torch's allocator holds unused, no device synchronisation). None
    on a CPU: the output layer's rule keeps its fixed budget there (planning/output_layer.py)."""
    from verl_hpc.runtime.device import free_memory_bytes

    return free_memory_bytes(device)


def pending_adam_bytes(optimizers) -> int:
    """Bytes Adam's moments will take on the device once they exist: torch creates an optimizer's
    state at its first step, so the memory free at the output layer of the first update (and of
    any pass before it) is larger by that much than at every later one, and the whole-or-chunks
    choice could differ between step 1 and step 2. Two moments per parameter, in the parameter's
    dtype (the local shard of a DTensor); 0 for an optimizer whose state exists."""
    total = 0
    for opt in optimizers:
        if opt is None or len(opt.state) > 0:
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                t = p.to_local() if hasattr(p, "to_local") else p
                total += 2 * t.numel() * t.element_size()
    return total


def agreed_free_bytes(device: torch.device, group=None, pending: int = 0) -> Optional[float]:
    """device_free_bytes less `pending` (pending_adam_bytes), the least over `group` (a
    tensor-parallel group must take one path: the chunked path all-reduces per chunk, the whole one
    per micro-batch). One small all-reduce and one read per micro-batch, before the chunks, never
    inside their loop."""
    free = device_free_bytes(device)
    if free is not None:
        free -= pending
    if free is None or group is None or dist.get_world_size(group) == 1:
        return free
    t = torch.tensor([free], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return float(t.item())


def whole_outputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, want: Sequence[str], *,
                  temperature: float = 1.0) -> Dict[str, torch.Tensor]:
    """The same results as token_outputs, from the whole logits at once (one rank's whole
    vocabulary): the logits in the weights' dtype, then fp32 and the temperature, log_softmax at the
    targets, the entropy and sum_v p_v^2 of the same distribution, as the engines' whole-logits
    paths compute them; autograd keeps the logits for the backward (nothing is recomputed)."""
    from verl_hpc.algorithms import entropy_from_logits, sum_pi_squared_from_logits

    unknown = set(want) - set(OUTPUTS)
    if unknown:
        raise ValueError(f"the output layer gives {OUTPUTS}; asked for {sorted(unknown)}")
    z = _chunk_logits(hidden, weight, temperature)
    out: Dict[str, torch.Tensor] = {}
    if "log_probs" in want:
        out["log_probs"] = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if "entropy" in want:
        out["entropy"] = entropy_from_logits(z).float()
    if "sum_pi_squared" in want:
        out["sum_pi_squared"] = sum_pi_squared_from_logits(z).float()
    return out
