"""The environment every vLLM engine of the project's is built with (rollout/vllm/environment.py),
and what it changes on vLLM's CUDA path, observed on a CPU: vLLM's CUDA platform class forced as the
current platform in a fresh interpreter, its one compiled import (`vllm._C_stable_libtorch`, not in
the CPU build) stood in for by an empty module. There, vLLM's default sampler imports FlashInfer
and fails without it, unless the environment says not to; and the import turns cuDNN's SDPA off."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from verl_hpc.config.errors import ConfigError
from verl_hpc.rollout.vllm import environment as env

ALL_SET = {env.MULTIPROCESSING: "0", env.FLASHINFER_SAMPLER: "0", env.V2_MODEL_RUNNER: "0"}


def test_without_flashinfer_the_sampler_variable_is_set_off():
    assert env.engine_environment({}, flashinfer=False) == ALL_SET


def test_with_flashinfer_vllm_keeps_its_default_sampler():
    assert env.FLASHINFER_SAMPLER not in env.engine_environment({}, flashinfer=True)


@pytest.mark.parametrize("user, flashinfer", [({env.FLASHINFER_SAMPLER: "0"}, False),
                                              ({env.FLASHINFER_SAMPLER: "1"}, True), ({env.V2_MODEL_RUNNER: "1"}, False)])
def test_what_the_user_set_is_kept(user, flashinfer):
    environ = dict(user)
    environ.update(env.engine_environment(environ, flashinfer=flashinfer))
    assert all(environ[k] == v for k, v in user.items())


def test_flashinfers_sampler_asked_without_flashinfer_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        env.engine_environment({env.FLASHINFER_SAMPLER: "1"}, flashinfer=False)
    line = str(e.value)
    assert "\n" not in line and "VLLM_USE_FLASHINFER_SAMPLER=1" in line and "flashinfer is not installed" in line


FORCED_CUDA = textwrap.dedent("""
    import json, sys, types
    import torch
    sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    from verl_hpc.runtime import attention  # before vLLM, as the job's runtime is
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    out = {"cudnn_after_import": torch.backends.cuda.cudnn_sdp_enabled()}
    with attention.training_attention():
        out["cudnn_in_training"] = torch.backends.cuda.cudnn_sdp_enabled()
    out["cudnn_after_training"] = torch.backends.cuda.cudnn_sdp_enabled()
    platforms._current_platform = CudaPlatform()
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, flashinfer_sampler_supported

    def sampler():
        try:
            return TopKTopPSampler("raw_logprobs").forward.__name__, flashinfer_sampler_supported()
        except ImportError as e:
            return f"{type(e).__name__}: {e}", None

    out["default"] = sampler()
    from verl_hpc.rollout.vllm import environment
    out["set"] = environment.apply()
    out["ours"] = sampler()
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.heavy  # a fresh interpreter imports vLLM (about 5 s)
def test_on_vllms_cuda_path_the_sampler_needs_no_flashinfer_and_training_keeps_cudnn():
    """The default build fails for want of FlashInfer (vLLM's V1 sampler with raw log-probs, as the
    judge and the quantization probe ask; its V2 runner's sampler asks the same function for any
    mode); with the project's environment it samples with PyTorch. Needs FlashInfer absent, as on
    the slim GPU kit and here."""
    assert not env.flashinfer_installed(), "flashinfer is installed here: the test needs it absent"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_USE_")}
    r = subprocess.run([sys.executable, "-c", FORCED_CUDA], capture_output=True, text=True, timeout=300, env=clean)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, r.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    assert out["default"][0] == "ModuleNotFoundError: No module named 'flashinfer'", out
    assert out["set"] == ALL_SET
    assert out["ours"] == ["forward_native", False], out
    assert out["cudnn_after_import"] is False  # what vLLM's import does to the whole process
    assert out["cudnn_in_training"] is True and out["cudnn_after_training"] is False
