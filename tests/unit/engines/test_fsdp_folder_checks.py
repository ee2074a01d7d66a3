"""The FSDP engine's folder and layout refusals before the queue (issue 67 item 8), one line each:
fsdp.cpu_offload on a CPU job (validation, naming the field), a config.json whose intermediate_size
disagrees with the stored weights (the tensor, its file and both shapes), a BertForMaskedLM folder
as the policy (its architecture, and what is valid); the engine's own build refuses the last two
where the submit check was skipped."""
import json
import shutil

import pytest

from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.launcher.preflight import model_problems

JOB = ["data.train_files=[t.parquet]", "rollout.n=2", "parallel.engine=auto"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM

    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("fsdp_folders")
    gemma = make_tiny_model(root / "gemma3", "gemma3", layers=2)
    edited = root / "edited"
    shutil.copytree(gemma, edited)
    config = json.loads((edited / "config.json").read_text())
    config["intermediate_size"] = 100  # the weights were saved with 256
    (edited / "config.json").write_text(json.dumps(config))
    bert = root / "bert"
    BertForMaskedLM(BertConfig(vocab_size=600, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(bert)
    for f in gemma.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, bert / f.name)
    return dict(gemma=gemma, edited=edited, bert=bert)


def test_cpu_offload_on_a_cpu_job_is_refused_by_validation():
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["model.path=/m"] + JOB + ["fsdp.cpu_offload=true"]), check_model=False)
    (line,) = [p for p in e.value.problems if p.startswith("fsdp.cpu_offload")]
    assert line.startswith("fsdp.cpu_offload = true needs GPUs") and "slurm.gpus_per_node = 0" in line
    validate(load_config(None, ["model.path=/m"] + JOB + ["fsdp.cpu_offload=true", "slurm.gpus_per_node=4",
                                                          "slurm.tasks_per_node=4"]), check_model=False)


def test_an_intermediate_size_that_disagrees_with_the_weights_names_tensor_and_shapes(folders):
    assert model_problems(load_config(None, [f"model.path={folders['gemma']}"] + JOB)) == []
    (line,) = model_problems(load_config(None, [f"model.path={folders['edited']}"] + JOB))
    assert line.startswith(f"model.path: tensor 'model.layers.0.mlp.down_proj.weight' in "
                           f"'{folders['edited'] / 'model.safetensors'}' has shape [128, 256]; "
                           f"'{folders['edited'] / 'config.json'}' builds [128, 100] (and "), line


def test_a_masked_lm_as_the_policy_is_refused_naming_its_architecture(folders):
    (line,) = model_problems(load_config(None, [f"model.path={folders['bert']}"] + JOB))
    assert line.startswith(f"model.path: '{folders['bert']}' is a BertForMaskedLM (bert), not a causal language "
                           "model") and "valid: a folder whose config.json names a causal-LM class" in line


def test_the_engine_build_refuses_a_masked_lm_too(folders):
    from verl_hpc.engines.fsdp.build import load_model
    from verl_hpc.trainer.roles import engine_options

    options = engine_options(load_config(None, [f"model.path={folders['bert']}"] + JOB), "actor")
    with pytest.raises(ConfigError, match="is a BertForMaskedLM \\(bert\\), not a causal language model"):
        load_model(options)


def test_the_engine_build_refuses_cpu_offload_without_a_gpu(folders, tmp_path):
    import torch.distributed as dist

    from verl_hpc.engines.fsdp.engine import FsdpEngine
    from verl_hpc.trainer.roles import engine_options

    cfg = load_config(None, [f"model.path={folders['gemma']}"] + JOB + ["fsdp.cpu_offload=true"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="fsdp.cpu_offload = true needs GPUs; this rank has none"):
            FsdpEngine(engine_options(cfg, "actor"), "model.path")
    finally:
        dist.destroy_process_group()
