"""Architectures vLLM loads and runs, but not as the trained model (rollout/vllm/support.py, DIFFERS).
The architecture matrix (tests/arch_matrix_run.py) found them on 552e1b0, where both ran to exit 0
with rollout.engine=vllm: the largest mean gap per step between the rollout's log-probs and the
update's forward was 4.1e-2 on GPT-OSS (1.2e-7 at step 1, before the first sync: vLLM kept the
folder's experts and sinks after every reload) and 2.4e-3 on Cohere 2 from step 1 (its sliding layers
see one token more than transformers'), against <= 2.3e-6 on every other architecture.

Here each is served, but not by that class: the rollout runs it in vLLM's Transformers modelling
backend (transformers' own model: tests/jobs/test_vllm_backend_archs.py holds the jobs to 1e-5), naming
the cause once in the log, and auto picks vLLM; and each cause is pinned in vLLM's source, so that the
choice is revisited (re-run the matrix, drop the entry) when a vLLM release changes it. Which release
each applies to: rollout/vllm/versions.py (vLLM 0.25's Cohere 2 window is transformers' own)."""
import importlib.util
import inspect
import logging

import pytest

from arch_matrix import make_arch
from verl_hpc.config import load_config
from verl_hpc.config.errors import ConfigError
from verl_hpc.rollout import factory
from verl_hpc.rollout.vllm import probe as vllm_probe
from verl_hpc.rollout.vllm import versions
from verl_hpc.rollout.vllm.support import DIFFERS, check_vllm_serves
from verl_hpc.trainer.roles import rollout_options

CASES = {"gpt_oss": ("GptOssForCausalLM", "experts and attention sinks"),
         "cohere2": ("Cohere2ForCausalLM", "sliding_window + 1 tokens")}
RELEASE = versions.release() if importlib.util.find_spec("vllm") else None


@pytest.mark.parametrize("arch", CASES)
def test_vllm_serves_it_through_the_transformers_backend_naming_the_cause(arch, tmp_path, monkeypatch, caplog):
    from verl_hpc.rollout.vllm import support as vllm_support
    from verl_hpc.rollout.vllm import transformers_backend as vllm_transformers

    name, cause = CASES[arch]
    if RELEASE is not None and name not in RELEASE.differs:  # 0.25's Cohere 2: its window is transformers'
        assert not vllm_support._differs(name)  # its own class serves it, if the probe says it loads
        return
    model = make_arch(tmp_path / arch, arch, weights=False)  # config.json decides: no weights needed
    monkeypatch.setattr(vllm_probe, "_run", lambda folders: pytest.fail(f"vLLM asked about {folders}"))
    monkeypatch.setattr(vllm_transformers, "_said", set())
    if name in RELEASE.backend_differs:  # 0.25's GPT-OSS: its backend is another model too; refused by name
        with pytest.raises(ConfigError, match=rf"{name} .*runs another model than the trained one in vLLM "
                                              rf".*its Transformers modelling backend runs another model"):
            check_vllm_serves(str(model), split=False)
        cfg = load_config(None, [f"model.path={model}", "rollout.engine=auto"])
        assert factory.choose_engine(rollout_options(cfg))[0] == "hf"  # auto takes HF generate
        return
    for split in (False, True):
        check_vllm_serves(str(model), split=split)  # no refusal
    engine, _ = factory.choose_engine(rollout_options(load_config(None, [f"model.path={model}", "rollout.engine=auto"])))
    assert engine == "vllm"
    with caplog.at_level(logging.INFO, logger="verl_hpc.rollout.vllm.transformers_backend"):
        assert [vllm_transformers.choose_impl(str(model)) for _ in range(2)] == ["transformers"] * 2
    said = [r.getMessage() for r in caplog.records if r.name == "verl_hpc.rollout.vllm.transformers_backend"]
    assert len(said) == 1 and said[0].startswith(f"vLLM rollout: {name} is not served by vLLM's own class (")
    assert cause in said[0] and "runs another model than the trained one" in said[0], said


def test_the_causes_are_still_in_vllms_source():
    """When one of these fails, vLLM changed the code the backend choice rests on: re-run the matrix
    for that architecture and drop its DIFFERS entry if vLLM's own class now equals the update."""
    pytest.importorskip("vllm", reason="the causes are in vLLM's source")
    from vllm.model_executor.models.commandr import CohereAttention
    from vllm.model_executor.models.gpt_oss import GptOssModel

    assert set(DIFFERS) == {name for name, _ in CASES.values()}
    assert set(RELEASE.differs) <= set(DIFFERS)
    loader = inspect.getsource(GptOssModel._load_weights_other)
    assert "param.copy_(narrow_weight)" in loader and ".w13_weight" in loader  # not through a weight_loader
    assert "param.data.copy_(narrow_weight)" in loader.split('"sinks" in name')[1]
    window = inspect.getsource(CohereAttention.__init__)
    if "Cohere2ForCausalLM" in RELEASE.differs:
        assert "self.sliding_window = config.sliding_window + 1" in window
    else:  # 0.25: transformers' window (its class is served as the trained model)
        assert "self.sliding_window = config.sliding_window\n" in window and "sliding_window + 1" not in window
