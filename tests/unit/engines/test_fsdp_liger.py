"""Liger-Kernel's fused kernels for the FSDP engine (verl_hpc/engines/fsdp/liger.py, fsdp.liger),
on CPU with the device and the library stubbed: the auto rule (never on a CPU, on with a GPU and
liger-kernel), the refusals, what the engine's start-up patches, and the output layer's wiring of
the fused linear cross-entropy (temperature, sign, shapes) against the chunked PyTorch path. The
kernels themselves are Triton: they run on the next GPU run (docs/benchmarks.md)."""
import importlib.machinery
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.fsdp import liger


def test_auto_is_on_only_with_a_gpu_and_the_library():
    assert liger.liger_choice(None, gpu=True, installed=True)[0] is True
    off_cpu, why = liger.liger_choice(None, gpu=False, installed=True)
    assert off_cpu is False and "no CUDA GPU" in why
    assert liger.liger_choice(None, gpu=True, installed=False) == (False, "liger-kernel is not installed")
    assert liger.liger_choice(False, gpu=True, installed=True)[0] is False
    assert liger.liger_choice(True, gpu=True, installed=True)[0] is True
    for gpu, installed in ((False, True), (True, False)):
        with pytest.raises(ConfigError, match="fsdp.liger = true"):
            liger.liger_choice(True, gpu=gpu, installed=installed)


def test_config_refuses_liger_on_a_cpu_job():
    from verl_hpc.config import load_config
    from verl_hpc.config.validate import validate

    with pytest.raises(ConfigError, match="fsdp.liger = true needs GPUs"):
        validate(load_config(None, ["fsdp.liger=true", "slurm.gpus_per_node=0"]), check_model=False)


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in liger_kernel: records the patch call; its fused linear cross-entropy is the plain
    formula (reduction none: -log p per token)."""
    calls = {}

    def apply(**kw):
        calls.update(kw)

    class FusedLinearCE:
        def __init__(self, reduction="mean"):
            assert reduction == "none"

        def __call__(self, weight, x, target):
            calls["flce_rows"] = x.shape[0]
            return torch.nn.functional.cross_entropy(x @ weight.t(), target, reduction="none")

    pkg = types.ModuleType("liger_kernel")
    pkg.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    sub = types.ModuleType("liger_kernel.transformers")
    sub._apply_liger_kernel_to_instance = apply
    sub.LigerFusedLinearCrossEntropyLoss = FusedLinearCE
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    return calls


def test_start_up_patches_norms_and_mlps_where_a_gpu_is(fake_liger, monkeypatch):
    import verl_hpc.runtime.device as device

    model = object()
    opts = SimpleNamespace(head="lm", fsdp=SimpleNamespace(liger=None))
    monkeypatch.setattr(device, "has_gpu", lambda: False)
    assert liger.setup_liger(model, opts) is False and not fake_liger
    monkeypatch.setattr(device, "has_gpu", lambda: True)
    assert liger.setup_liger(model, SimpleNamespace(head="value", fsdp=opts.fsdp)) is False and not fake_liger
    assert liger.setup_liger(model, opts) is True
    assert fake_liger == dict(model=model, rms_norm=True, swiglu=True, rope=False, cross_entropy=False,
                              fused_linear_cross_entropy=False)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_takes_log_probs_alone_from_the_fused_loss(fake_liger, temperature):
    from verl_hpc.engines.fsdp.head import ChunkedHead
    from verl_hpc.engines.logits import token_outputs

    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(8, 40, bias=False)
    hidden = torch.randn(3, 9, 8, generator=g)
    rows, pos = torch.arange(3).unsqueeze(1), torch.arange(1, 7).expand(3, 6)
    targets = torch.randint(0, 40, (3, 6), generator=g)
    head = ChunkedHead(linear, 4, temperature, liger=True)
    with head.scoring(rows, pos, targets, ("log_probs",)):
        got = ChunkedHead.results((linear(hidden),), ("log_probs",))["log_probs"]
    want = token_outputs(hidden[rows, pos], linear.weight, targets, ("log_probs",), temperature=temperature)
    assert fake_liger["flce_rows"] == 18
    assert float((got - want["log_probs"]).detach().abs().max()) <= 1e-6
    fake_liger.clear()
    with head.scoring(rows, pos, targets, ("log_probs", "entropy")):  # entropy: the chunked path
        linear(hidden)
    assert "flce_rows" not in fake_liger
