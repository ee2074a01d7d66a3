"""The training engines' attention kernels beside vLLM (runtime/attention.py): vLLM's CUDA platform
turns cuDNN's SDPA off for the whole process at its import; the engines' forward and train step
run with the backends the process had before it, and vLLM's choice is back after each call.

vLLM's import is stood in for by its module name in sys.modules and the flag it sets (the flags are
process-wide booleans on every torch build, CPU included); the import itself is tested beside the
sampler in tests/unit/rollout/test_rol_vllm_environment.py."""
import sys
import types

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from update_reference import policy_batch
from verl_hpc.runtime import attention


@pytest.fixture
def vllm_imported(monkeypatch):
    """What importing vllm/platforms/cuda.py leaves: its module loaded, cuDNN's SDPA flag off."""
    monkeypatch.setitem(sys.modules, attention.VLLM_CUDA_PLATFORM, types.ModuleType(attention.VLLM_CUDA_PLATFORM))
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_without_vllm_the_flags_are_left_as_they_are():
    before = attention.sdpa_flags()
    with attention.training_attention():
        assert attention.sdpa_flags() == before
    assert not attention.vllm_turned_cudnn_off()


def test_after_vllms_import_training_runs_with_cudnn_and_vllm_gets_its_choice_back(vllm_imported):
    assert attention.vllm_turned_cudnn_off()
    with attention.training_attention():
        assert attention.sdpa_flags()["cudnn"]
    assert not attention.sdpa_flags()["cudnn"]


def test_a_callers_own_backend_choice_is_kept(vllm_imported):
    """The GPU check's deterministic backward runs the engine under sdpa_kernel([MATH]): not vLLM's
    change, so it stays as the caller set it."""
    with sdpa_kernel([SDPBackend.MATH]):
        chosen = attention.sdpa_flags()
        with attention.training_attention():
            assert attention.sdpa_flags() == chosen


def _record_sdpa(monkeypatch) -> list:
    """cuDNN's flag at every SDPA call of the model (transformers' and the Megatron engine's core
    attention both call torch.nn.functional.scaled_dot_product_attention by attribute)."""
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    return seen


def _nll(out, mb, counts):
    return -(out["log_probs"] * mb["response_mask"]).sum() / counts.tokens, {}


@pytest.mark.heavy  # two engines built and stepped
@pytest.mark.parametrize("engine", ["megatron", "fsdp"])
def test_both_engines_forward_and_step_run_with_cudnn_beside_vllm(one_rank_world, tmp_path, monkeypatch,
                                                                    vllm_imported, engine):
    from verl_hpc.engines.options import default_options
    from verl_hpc.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "model", "llama", layers=1)
    options = default_options(str(folder), engine=engine, micro_batch_size=2, total_steps=2)
    if engine == "megatron":
        from verl_hpc.engines.megatron import MegatronEngine
        from verl_hpc.parallel import init_model_parallel

        init_model_parallel(1, 1)
        model = MegatronEngine(options)
    else:
        from verl_hpc.engines.fsdp import FsdpEngine

        model = FsdpEngine(options)
    seen = _record_sdpa(monkeypatch)
    batch = policy_batch(1, n=2)
    model.forward(batch)
    model.train_step(batch, _nll)
    assert seen and all(seen), seen  # every attention call of the forward and the step
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # vLLM's choice outside them
