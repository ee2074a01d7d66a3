"""Architectures vLLM loads and runs, but not as the trained model (rollout/vllm_support.py, DIFFERS).
The architecture matrix (tests/arch_matrix_run.py) found them on 552e1b0, where both ran to exit 0
with rollout.engine=vllm: the largest mean gap per step between the rollout's log-probs and the
update's forward was 4.1e-2 on GPT-OSS (1.2e-7 at step 1, before the first sync: vLLM kept the
folder's experts and sinks after every reload) and 2.4e-3 on Cohere 2 from step 1 (its sliding layers
see one token more than transformers'), against <= 2.3e-6 on every other architecture.

Here each is refused before the queue in one line naming the cause and rollout.engine=hf, and auto
rolls it out with HF generate; and each cause is pinned in vLLM's source, so that the refusal is
revisited (re-run the matrix, drop the entry) when a vLLM release changes it."""
import inspect

import pytest

from arch_matrix import make_arch
from verl_hpc.config import ConfigError, load_config
from verl_hpc.rollout import factory, vllm_probe
from verl_hpc.rollout.vllm_support import DIFFERS, check_vllm_serves
from verl_hpc.trainer.roles import rollout_options

CASES = {"gpt_oss": ("GptOssForCausalLM", "experts and attention sinks"),
         "cohere2": ("Cohere2ForCausalLM", "sliding_window + 1 tokens")}


@pytest.mark.parametrize("arch", CASES)
def test_vllm_is_refused_before_the_queue_and_auto_picks_hf(arch, tmp_path, monkeypatch):
    name, cause = CASES[arch]
    model = make_arch(tmp_path / arch, arch, weights=False)  # config.json decides: no weights needed
    monkeypatch.setattr(vllm_probe, "_run", lambda folders: pytest.fail(f"vLLM asked about {folders}"))
    with pytest.raises(ConfigError) as e:
        check_vllm_serves(str(model), split=False)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"rollout.engine=vllm cannot serve model.path {name} ('{model}'): ")
    assert cause in text and "runs another model than the trained one" in text and "set rollout.engine=hf" in text
    with pytest.raises(ConfigError):  # vLLM on ranks of its own reloads and attends the same way
        check_vllm_serves(str(model), split=True)
    engine, why = factory.choose_engine(rollout_options(load_config(None, [f"model.path={model}", "rollout.engine=auto"])))
    assert engine == "hf" and cause in why, why


def test_the_causes_are_still_in_vllms_source():
    """When one of these fails, vLLM changed the code the refusal rests on: re-run the matrix for
    that architecture and drop its DIFFERS entry if the rollout now equals the update."""
    pytest.importorskip("vllm", reason="the causes are in vLLM's source")
    from vllm.model_executor.models.commandr import CohereAttention
    from vllm.model_executor.models.gpt_oss import GptOssModel

    assert set(DIFFERS) == {name for name, _ in CASES.values()}
    loader = inspect.getsource(GptOssModel._load_weights_other)
    assert "param.copy_(narrow_weight)" in loader and ".w13_weight" in loader  # not through a weight_loader
    assert "param.data.copy_(narrow_weight)" in loader.split('"sinks" in name')[1]
    assert "self.sliding_window = config.sliding_window + 1" in inspect.getsource(CohereAttention.__init__)
