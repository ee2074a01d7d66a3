"""`python -m verl_hpc.checkpoint export CKPT --hf OUT` of the FSDP engine's checkpoints (issue 50,
item 3): a Llama's (Megatron's coordinates: the same names as the Megatron engine's, converted by
the same rules) and an OLMo 2's (an architecture Megatron does not map: HF names, written as they
are). Each checkpoint is a one-rank FSDP engine's after one update, saved as the checkpointer does;
the exported folder must load in transformers and give the engine's own logits."""
import gc

import pytest
import torch

from engine_states import engine, make_batch, one_rank_world, save, update
from verl_hpc.checkpoint.__main__ import main

IDS = torch.randint(5, 480, (3, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=["llama", "olmo2"])
def trained(request, tmp_path_factory):
    """(model folder, checkpoint, the engine's logits of IDS after its update, engine meta)."""
    from engine_states import tiny_unmapped_model
    from verl_hpc.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp(f"fsdp_export_{request.param}")
    folder = (make_tiny_model(tmp / "model", "llama", layers=2, seed=3) if request.param == "llama"
              else tiny_unmapped_model(tmp / "model", "olmo2", seed=3))
    with one_rank_world(tmp / "world"):
        eng = engine("fsdp", folder)
        update(eng, make_batch(5))
        meta = save(eng, tmp / "ckpt", 1, {"fsdp": 1})
        with torch.no_grad():
            logits = eng.model(input_ids=IDS).logits.detach().clone()
        del eng
        gc.collect()
    return folder, tmp / "ckpt", logits, meta


def test_export_of_an_fsdp_checkpoint_gives_the_engines_logits(trained, tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder, ckpt, logits, meta = trained
    assert meta["coords"] == ("megatron" if meta["architecture"] == "Llama" else "hf")
    assert main(["export", str(ckpt), "--hf", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    with safe_open(str(folder / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())  # the folder's own HF names, all of them
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    start = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        got, before = model(IDS).logits, start(IDS).logits
    diff = float((got - logits).abs().max())
    print(f"{meta['architecture']} ({meta['coords']} coordinates): max |export logits - engine logits| = {diff:.1e}")
    assert diff <= 1e-5
    assert float((before - logits).abs().max()) > 1e-3  # the export is the trained model
