"""The Megatron engine without Transformer Engine or apex (engines/megatron/kernels.py), on CPU:
torch's norm modules built in the compute dtype (bf16 weights for bf16 input, so that torch's fused
rms_norm dispatches on a GPU), the rest of the model untouched, the weights loaded as before, and
the start-up line naming each kernel per setting."""
import logging

import pytest
import torch

from verl_hpc.engines.megatron.kernels import PerfOptions, kernel_report, norms_in_compute_dtype


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kern") / "llama", family="llama", layers=2)


def _build(folder, dtype, perf=PerfOptions()):
    from verl_hpc.engines.megatron.build import build_chunks
    from verl_hpc.engines.options import default_options
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    o = default_options(str(folder), dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    return build_chunks(o, dtype, False, perf)[0]


def _norms(chunks):
    return [m for g in chunks for m in g.modules() if type(m) in (torch.nn.RMSNorm, torch.nn.LayerNorm)]


def test_a_bf16_build_has_its_norms_in_bf16(one_rank_world, folder, caplog):
    from safetensors.torch import load_file

    with caplog.at_level(logging.INFO, logger="verl_hpc.engines.megatron.build"):
        chunks = _build(folder, torch.bfloat16)
    norms = _norms(chunks)
    assert len(norms) == 2 * 2 + 1  # per layer: input and pre-MLP; the final norm
    assert {p.dtype for n in norms for p in n.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in chunks[0].parameters()} == {torch.bfloat16}  # nothing else left in fp32
    # the HF weights arrive as before (bf16 rounding of the checkpoint's values)
    hf = {}
    for f in sorted(folder.glob("*.safetensors")):
        hf.update(load_file(f))
    w = chunks[0].decoder.layers[0].input_layernorm.weight
    torch.testing.assert_close(w, hf["model.layers.0.input_layernorm.weight"].to(torch.bfloat16))
    report = kernel_report(chunks, PerfOptions())
    assert "weight bfloat16 (torch's fused rms_norm)" in report["norm"], report
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Megatron kernels:")]
    assert len(line) == 1 and "torch's fused rms_norm" in line[0] and "swiglu: unfused" in line[0]


def test_an_fp32_build_is_untouched(one_rank_world, folder):
    chunks = _build(folder, torch.float32)
    assert {p.dtype for n in _norms(chunks) for p in n.parameters()} == {torch.float32}
    assert norms_in_compute_dtype(chunks, torch.float32) == 0


def test_the_cast_reaches_only_torch_norms():
    """Modules that are not torch's norm classes keep their dtype (an fp32 adapter or value head,
    a norm class of another library with the same name)."""
    class RMSNorm(torch.nn.Module):  # a library's own RMSNorm (apex / TE make theirs in params_dtype)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

    model = torch.nn.ModuleDict({"torch_norm": torch.nn.RMSNorm(4), "other": RMSNorm(),
                                 "head": torch.nn.Linear(4, 1), "ln": torch.nn.LayerNorm(4)})
    assert norms_in_compute_dtype([model], torch.bfloat16) == 2
    assert model["torch_norm"].weight.dtype == model["ln"].weight.dtype == torch.bfloat16
    assert model["other"].weight.dtype == model["head"].weight.dtype == torch.float32


@pytest.mark.parametrize("perf, expect", [
    (PerfOptions(), {"swiglu": "unfused", "rope": "unfused", "grad-accum fusion": "off"}),
    (PerfOptions(bias_activation_fusion=True), {"swiglu": "fused (Megatron's bias_swiglu, jit_fuser = "}),
    (PerfOptions(apply_rope_fusion=True), {"rope": "fused (Transformer Engine)"}),
    (PerfOptions(gradient_accumulation_fusion=True), {"grad-accum fusion": "on"}),
])
def test_the_report_names_the_kernel_each_setting_picks(one_rank_world, folder, perf, expect):
    chunks = _build(folder, torch.float32)
    report = kernel_report(chunks, perf)
    for key, start in expect.items():
        assert report[key].startswith(start), (key, report)
    assert report["attention"] == "SdpaCoreAttention (torch SDPA)"
    assert "weight float32 (torch's fused rms_norm)" in report["norm"]


def test_fused_cross_entropy_is_chosen_per_setting_and_reaches_megatron():
    """model.cross_entropy_loss_fusion: auto on with a GPU (Megatron's native kernel, no TE), off on
    a CPU, true refused there; on, Megatron's config gets the native implementation."""
    from verl_hpc.engines.megatron.kernels import Availability, KernelSwitches

    gpu, cpu = Availability(gpu=True, te=False, grad_accum_ext=False), Availability(False, False, False)
    auto = KernelSwitches()
    assert auto.resolve(trainable=True, use_distributed_optimizer=False, available=gpu).cross_entropy_loss_fusion
    assert not auto.resolve(trainable=True, use_distributed_optimizer=False, available=cpu).cross_entropy_loss_fusion
    assert not KernelSwitches(cross_entropy_loss_fusion=False).resolve(
        trainable=True, use_distributed_optimizer=False, available=gpu).cross_entropy_loss_fusion
    with pytest.raises(ValueError, match="model.cross_entropy_loss_fusion=true needs a CUDA GPU"):
        KernelSwitches(cross_entropy_loss_fusion=True).resolve(trainable=True, use_distributed_optimizer=False,
                                                               available=cpu)
    over = PerfOptions(cross_entropy_loss_fusion=True).transformer_overrides()
    assert over["cross_entropy_loss_fusion"] is True and over["cross_entropy_fusion_impl"] == "native"
    assert "cross_entropy_loss_fusion" not in PerfOptions().transformer_overrides()


def test_whole_bf16_logits_take_the_fused_cross_entropy(one_rank_world, monkeypatch):
    """lm_outputs with fused_ce: bf16 logits' log-probs through Megatron's fused function (spied:
    it compiles with torch.compile, a GPU's job), the same values as the unfused one; fp32 logits
    keep the unfused one (the fused backward returns bf16)."""
    import megatron.core.fusions.fused_cross_entropy as fused
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from verl_hpc.engines.megatron import outputs as mo
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    calls = []

    def spy(logits, target, group):
        calls.append(logits.dtype)
        return vocab_parallel_cross_entropy(logits, target)

    monkeypatch.setattr(fused, "fused_vocab_parallel_cross_entropy", spy)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 16, generator=g)
    mb = {"_targets": torch.randint(0, 16, (2, 5), generator=g)}
    want = ("log_probs", "entropy")
    plain = mo.lm_outputs(logits.bfloat16(), mb, want, selected=True)
    fused_out = mo.lm_outputs(logits.bfloat16(), mb, want, selected=True, fused_ce=True)
    assert calls == [torch.bfloat16]
    torch.testing.assert_close(plain["log_probs"], fused_out["log_probs"])
    mo.lm_outputs(logits, mb, want, selected=True, fused_ce=True)
    assert calls == [torch.bfloat16]  # fp32: the unfused function
