"""`python -m verl_hpc.checkpoint export CKPT --hf OUT` of FSDP checkpoints of held-out
architectures (tests/arch_matrix.py): GPT-2 (Conv1D, tied), BLOOM (eager attention, tied), Falcon
(fused query_key_value) and GPT-NeoX (a folder storing embed_out.weight, which transformers 5 calls
lm_head). One update on a one-rank FSDP engine, saved as the checkpointer does; the exported folder
stores its tensors under the source folder's names (cec2796 wrote GPT-NeoX's head as lm_head.weight),
loads in transformers with no tensor missing or left unused and gives the engine's logits."""
import gc
from pathlib import Path

import pytest
import torch

from arch_matrix import make_arch
from engine_states import engine, make_batch, one_rank_world, save, update
from verl_hpc.checkpoint.__main__ import main

IDS = torch.randint(5, 480, (3, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["gpt2", "bloom", "falcon", "gpt_neox"])
def test_export_of_a_held_out_architecture_gives_the_engines_logits(arch, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    folder = make_arch(tmp_path / "model", arch, seed=3, tied=arch in ("gpt2", "bloom"))
    with one_rank_world(tmp_path / "world"):
        eng = engine("fsdp", folder)
        update(eng, make_batch(5))
        meta = save(eng, tmp_path / "ckpt", 1, {"fsdp": 1})
        with torch.no_grad():
            logits = eng.model(input_ids=IDS).logits.detach().clone()
        del eng
        gc.collect()
    assert meta["coords"] == "hf"
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    assert _stored(tmp_path / "hf") == _stored(folder)  # GPT-NeoX: embed_out.weight, as the folder has it
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    start = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        got, before = model.eval()(IDS).logits, start(IDS).logits
    assert float((got - logits).abs().max()) <= 1e-5
    assert float((before - logits).abs().max()) > 1e-3  # the export is the trained model


def _stored(folder):
    from safetensors import safe_open

    names = []
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    return sorted(names)
