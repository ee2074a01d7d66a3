"""Model folders of architectures the Megatron mapping does not cover, before the queue and in the
rank: the FSDP engine's roles take any architecture transformers loads; a folder transformers
cannot load, or one that ships its own modelling code while model.trust_remote_code is off, is one
line naming the folder, its architecture and the way out (issue 50)."""
import json
import shutil

import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.launcher.preflight import preflight

ROW = {"prompt": "2+2?", "data_source": "gsm8k", "ground_truth": "4"}
REMOTE_CONFIG = "from transformers import Phi3Config\n\nclass TinyConfig(Phi3Config):\n    model_type = 'tinyremote'\n"
REMOTE_MODEL = ("from transformers import Phi3ForCausalLM\nfrom .configuration_tiny import TinyConfig\n\n"
                "class TinyRemoteForCausalLM(Phi3ForCausalLM):\n    config_class = TinyConfig\n")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("arch") / "phi3", "phi3")


@pytest.fixture
def job(tmp_path, phi3):
    """A valid RL job on a copy of the tiny Phi-3; returns (overrides, model folder)."""
    model = tmp_path / "model"
    shutil.copytree(phi3, model)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(ROW) + "\n" for _ in range(8)))
    return [f"model.path={model}", f"data.train_files=[{train}]", f"trainer.output_dir={tmp_path}/out",
            f"slurm.log_dir={tmp_path}/logs/%j", "rollout.n=2"], model


def problem(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        preflight(load_config(None, overrides))
    assert len(e.value.problems) == 1, e.value
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _edit_config(model, **changes):
    f = model / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}))


def test_fsdp_takes_an_architecture_megatron_does_not_map_and_megatron_names_the_way_out(job):
    overrides, model = job
    preflight(load_config(None, [*overrides, "parallel.engine=fsdp"]))
    preflight(load_config(None, [*overrides, "parallel.engine=auto"]))  # tp 1: FSDP
    assert problem([*overrides, "parallel.engine=megatron"]).startswith(
        f"model.path: {model / 'config.json'}: architectures=['Phi3ForCausalLM'] is not mapped into Megatron")
    assert "set parallel.engine=fsdp" in problem([*overrides, "parallel.engine=megatron"])
    # auto with tensor parallelism: no engine has both
    assert "FSDP has no tensor, pipeline or expert parallelism" in problem(
        [*overrides, "parallel.engine=auto", "parallel.tp=2"])


def test_a_folder_transformers_cannot_load_names_the_path_and_the_architecture(job):
    overrides, model = job
    _edit_config(model, model_type="phi9000")
    line = problem([*overrides, "parallel.engine=fsdp"])
    assert line.startswith(f"model.path: transformers cannot load '{model}' (Phi3ForCausalLM): "), line
    assert "phi9000" in line and "model.trust_remote_code=true" in line


def test_remote_code_needs_model_trust_remote_code(job):
    """A config.json whose auto_map points at modelling files in the folder: refused in one line
    naming model.trust_remote_code while it is off, taken when it is on (before the queue, and by
    the FSDP engine's own check in the rank)."""
    from verl_hpc.engines.fsdp.build import hf_config

    overrides, model = job
    _edit_config(model, model_type="tinyremote", architectures=["TinyRemoteForCausalLM"],
                 auto_map={"AutoConfig": "configuration_tiny.TinyConfig",
                           "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM"})
    (model / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (model / "modeling_tiny.py").write_text(REMOTE_MODEL)
    want = (f"model.path: '{model}' (TinyRemoteForCausalLM) ships its own modelling code, which runs only with "
            "model.trust_remote_code=true (it executes code from the folder)")
    assert problem([*overrides, "parallel.engine=fsdp"]) == want
    with pytest.raises(ConfigError) as e:
        hf_config(str(model), False, "model.path")
    assert str(e.value) == want
    # vLLM has no class for a remote architecture (its backend is refused in a colocated job): HF generate
    preflight(load_config(None, [*overrides, "parallel.engine=fsdp", "model.trust_remote_code=true",
                                 "safety.allow_custom_code=true", "rollout.engine=hf"]))
    assert type(hf_config(str(model), True, "model.path")).__name__ == "TinyConfig"


@pytest.mark.parametrize("change,words", [
    ("drop", "no tensor 'model.layers.1.mlp.down_proj.weight', which config.json implies"),
    ("reshape", "tensor 'model.layers.1.mlp.down_proj.weight' has shape [128, 64], the model built from "
                "config.json has [128, 256]"),
])
def test_fsdp_engine_refuses_weights_that_disagree_with_config_json(job, change, words):
    """Past the submitter (which leaves an unmapped architecture's tensors to transformers): a tensor
    transformers would start at random, or a shape it would refuse without naming, is one line."""
    from types import SimpleNamespace

    from safetensors.torch import load_file, save_file

    from verl_hpc.engines.fsdp.build import load_model

    _, model = job
    f = model / "model.safetensors"
    state = load_file(f)
    name = "model.layers.1.mlp.down_proj.weight"
    if change == "drop":
        del state[name]
    else:
        state[name] = state[name][:, :64].contiguous()
    save_file(state, f, metadata={"format": "pt"})
    options = SimpleNamespace(model_path=str(model), trust_remote_code=False, head="lm")
    with pytest.raises(ConfigError) as e:
        load_model(options)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"model.path: transformers cannot load the weights of '{model}' (Phi3Config): "
                                   f"{words}"), e.value
