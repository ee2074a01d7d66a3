"""The dtype of every GEMM on the output layer's paths (issue 85, suspect 1). With bf16 weights and
hidden states every matrix product must take bf16 operands: an fp32 one is, on an H100/H200 with
TF32 off (torch's default), a CUDA-core SGEMM at about a tenth of the bf16 tensor-core rate. The
weight gradient is still summed over the chunks in fp32 (addmm's fp32 out_dtype).

A dispatch-mode recorder sees each GEMM's operands. The device is stood in for by `meta`, which
has the fp32-output addmm kernel a GPU has and the CPU lacks (the CPU keeps the upcast form, whose
arithmetic the other chunked-logits tests check)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul"}


class GemmRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []  # (op, operand dtypes, result dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1].rstrip("_")  # addmm_ (in place) is an addmm too
        if name in GEMMS:
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            if name in ("addmm", "baddbmm"):
                mats = mats[1:]  # the accumulator is not an operand
            res = out if isinstance(out, torch.Tensor) else None
            self.seen.append((name, tuple(m.dtype for m in mats), None if res is None else res.dtype))
        return out


def _inputs(dtype, device="meta", n=40, v=96, h=16):
    hidden = torch.empty(n, h, dtype=dtype, device=device).requires_grad_()
    weight = torch.empty(v, h, dtype=dtype, device=device).requires_grad_()
    targets = torch.zeros(n, dtype=torch.long, device=device)
    return hidden, weight, targets


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("want", [("log_probs",), ("log_probs", "entropy")])
def test_every_gemm_of_the_chunked_update_takes_bf16_operands(monkeypatch, fused, want):
    from verl_hpc.engines import logits, logits_fused

    monkeypatch.setattr(logits_fused, "COMPILE", False)
    logits.low_precision_addmm(torch.device("meta"))  # its one-off probe (cached) is not the update's
    hidden, weight, targets = _inputs(torch.bfloat16)
    with GemmRecorder() as rec:
        out = logits.token_outputs(hidden, weight, targets, want, chunk=16, fused=fused)
        loss = sum(v.sum() for v in out.values())
        loss.backward()
    assert rec.seen, "no GEMM recorded"
    fp32 = [s for s in rec.seen if torch.float32 in s[1]]
    assert not fp32, f"fp32 GEMM operands on the chunked path: {fp32}"
    # the weight's gradient: summed in fp32 over the 3 chunks, returned in the weights' dtype
    assert sum(1 for op, _, res in rec.seen if op == "addmm" and res == torch.float32) == 3
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16


def test_the_whole_logits_gemms_take_bf16_operands():
    from verl_hpc.engines.logits import whole_outputs

    hidden, weight, targets = _inputs(torch.bfloat16)
    with GemmRecorder() as rec:
        out = whole_outputs(hidden, weight, targets, ("log_probs", "entropy"))
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert rec.seen and not [s for s in rec.seen if torch.float32 in s[1]], rec.seen


def test_the_fp32_form_is_there_for_the_benchmark(monkeypatch):
    """WEIGHT_GRAD_GEMM = "fp32" gives the upcast form back (what bench_gpu_logits times beside it)."""
    from verl_hpc.engines import logits

    monkeypatch.setattr(logits, "WEIGHT_GRAD_GEMM", "fp32")
    hidden, weight, targets = _inputs(torch.bfloat16)
    with GemmRecorder() as rec:
        logits.token_outputs(hidden, weight, targets, ("log_probs",), chunk=16)["log_probs"].sum().backward()
    assert ("addmm", (torch.float32, torch.float32), torch.float32) in rec.seen


def test_the_cpu_keeps_the_upcast_form_and_the_same_gradient():
    """The CPU has no fp32-output bf16 addmm: there the upcast form runs, and its weight gradient
    equals the fp32 reference of the same bf16 operands to summation order."""
    from verl_hpc.engines import logits

    assert not logits.low_precision_addmm(torch.device("cpu"))
    assert logits.low_precision_addmm(torch.device("meta"))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g).to(torch.bfloat16).requires_grad_()
    weight = (0.3 * torch.randn(96, 16, generator=g)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 96, (40,), generator=g)
    logits.token_outputs(hidden, weight, targets, ("log_probs",), chunk=16)["log_probs"].sum().backward()
    w32 = weight.detach().float().requires_grad_()
    lp = logits.whole_outputs(hidden.detach().float(), w32, targets, ("log_probs",))["log_probs"]
    (g_ref,) = torch.autograd.grad(lp.sum(), w32)
    assert float((weight.grad.float() - g_ref).abs().max()) <= 0.02 * float(g_ref.abs().max())
