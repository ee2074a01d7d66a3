"""DeepSeek-V3 folders and multi-token prediction (issue 67 item 13): config.json's
num_nextn_predict_layers with the MTP layers stored after the decoder's or not stored at all (what
save_pretrained and `checkpoint export --hf` write) is a valid model.path; the MTP layers are never
loaded, so the HF rollout's name check and every weight stream leave them out."""
from pathlib import Path

import pytest
import torch
from model_folders import copy_saying
from safetensors.torch import load_file, save_file

from verl_hpc.config import load_config
from verl_hpc.launcher.preflight import model_problems
from verl_hpc.rollout.weights import checkpoint_weight_names

JOB = ["data.train_files=[t.parquet]", "rollout.n=2"]


def _with_mtp(src: Path, out: Path, *, stored_layers: int) -> Path:
    """A copy of the 2-layer tiny DeepSeek-V3 saying num_nextn_predict_layers = 1, with
    `stored_layers` extra layers stored after the decoder's (copies of the last one plus the MTP
    projection and norms, as the released checkpoints store layer 61)."""
    config, state = copy_saying(src, out, num_nextn_predict_layers=1)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    last = f"model.layers.{layers - 1}."
    for k in range(stored_layers):
        extra = f"model.layers.{layers + k}."
        state.update({extra + n[len(last):]: t.clone() for n, t in list(state.items()) if n.startswith(last)})
        state[extra + "eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
        state[extra + "enorm.weight"], state[extra + "hnorm.weight"] = torch.ones(hidden), torch.ones(hidden)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("mtp")
    plain = make_tiny_model(root / "plain", "deepseek_v3", layers=2, seed=3)
    return {k: _with_mtp(plain, root / k, stored_layers=n) for k, n in (("unstored", 0), ("stored", 1), ("two", 2))}


def _problems(folder):
    return model_problems(load_config(None, JOB + [f"model.path={folder}"]))


def test_mtp_in_config_json_with_or_without_its_weights_is_a_valid_model_path(folders):
    assert _problems(folders["unstored"]) == []  # an export's folder can be model.path again
    assert _problems(folders["stored"]) == []


def test_more_stored_layers_than_decoder_plus_mtp_is_still_refused(folders):
    (line,) = _problems(folders["two"])
    assert "has num_hidden_layers = 2 and num_nextn_predict_layers = 1 (stored or not), the weights hold layers " \
           "0..3 (4 layers) (e.g. 'model.layers.3." in line and "\n" not in line


def test_the_hf_rollout_ignores_stored_mtp_layers_and_takes_the_decoders_weights(folders):
    from verl_hpc.rollout import HFRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    folder = folders["stored"]
    names = checkpoint_weight_names(folder)
    assert names and not any(n.startswith("model.layers.2.") for n in names)
    engine = HFRollout(str(folder), **default_engine_args("hf", max_prompt_length=16, max_response_length=4))
    state = {n: t for n, t in load_file(str(folder / "model.safetensors")).items() if n in names}
    info = engine.load_weights(iter(state.items()))  # a sync sends the decoder's weights, never the MTP layer's
    assert info["tensors"] == len(state)
