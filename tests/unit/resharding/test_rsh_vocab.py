"""The sliced sync finds a model's vocabulary tensors through its own accessors (models/vocab_tensors.py),
not by Llama's names: on cec2796 a GPT-NeoX or Falcon embedding at inference TP > 1 had "no
rule" in the plan, so resharding.mode=auto fell back to the full path for every family whose embedding is
not model.embed_tokens. Here the non-Llama families' embeddings and heads are cut as vLLM cuts any
vocabulary tensor (rows of the vocabulary padded to 64, split evenly), and split placement's publisher
reads the geometry of a family outside the Megatron mapping from its config.json."""
import logging

import pytest
import torch

from arch_matrix import make_arch
from verl_hpc.resharding.plan import rollout_slicer
from verl_hpc.resharding.plan import PlanError, RolloutSlicer
from verl_hpc.models.vocab_tensors import folder_geometry, folder_vocab_names, vocab_names

NEOX = ("gpt_neox.embed_in.weight", "lm_head.weight")
FALCON = ("transformer.word_embeddings.weight", "lm_head.weight")  # tied: one tensor, both names


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return {"gpt_neox": make_arch(root / "neox", "gpt_neox", weights=False),
            "falcon": make_arch(root / "falcon", "falcon", tied=True, weights=False),
            "gpt2": make_arch(root / "gpt2", "gpt2", tied=True, weights=False),
            "starcoder2": make_arch(root / "starcoder2", "starcoder2", weights=False)}


def test_the_vocabulary_tensors_are_the_models_own(folders):
    assert folder_vocab_names(folders["gpt_neox"]) == NEOX
    assert folder_vocab_names(folders["falcon"]) == FALCON
    assert folder_vocab_names(folders["gpt2"]) == ("transformer.wte.weight", "lm_head.weight")
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # a loaded model (the FSDP engine's) answers the same
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders["gpt_neox"]))
    assert vocab_names(model) == NEOX
    assert folder_vocab_names(folders["gpt_neox"] / "missing") == ("model.embed_tokens.weight", "lm_head.weight")


def test_a_non_llama_vocabulary_is_cut_like_vllms_padded_vocabulary(folders):
    head_dim, vocab = folder_geometry(folders["gpt_neox"])
    assert (head_dim, vocab) == (32, 500)
    llama_names = RolloutSlicer(2, head_dim=head_dim, vocab_size=vocab)
    with pytest.raises(PlanError, match="gpt_neox.embed_in.weight: no rule"):  # what auto fell back on
        llama_names.need("gpt_neox.embed_in.weight", (500, 128), 0)
    s2 = RolloutSlicer(2, head_dim=head_dim, vocab_size=vocab, vocab=NEOX)
    s4 = RolloutSlicer(4, head_dim=head_dim, vocab_size=vocab, vocab=FALCON)
    # vocabulary 500 -> 512 padded: 256 rows per rank at TP 2, 128 at TP 4; the last rank's real part ends at 500
    assert [s2.need(n, (500, 128), r) for n in NEOX for r in range(2)] == [(0, 0, 256), (0, 256, 500)] * 2
    assert [s4.need(FALCON[0], (500, 128), r) for r in range(4)] == [
        (0, 0, 128), (0, 128, 256), (0, 256, 384), (0, 384, 500)]


def test_split_placement_slices_a_family_outside_the_megatron_mapping(folders, caplog):
    """The publisher's slicer for Falcon (a class of vLLM's own) from its config.json (load_arch refused
    any family outside the Megatron mapping); Starcoder2 at rollout.tp 2 runs in vLLM's Transformers
    backend (no class of vLLM's own in 0.25 or 0.32), which cuts by the model's own plan: auto
    publishes full tensors and says why, sliced is refused."""
    falcon = rollout_slicer("auto", str(folders["falcon"]), 2)
    assert falcon.need(FALCON[0], (500, 128), 1) == (0, 256, 500) and falcon.head_dim == 32
    assert rollout_slicer("auto", str(folders["gpt_neox"]), 1).vocab == frozenset(NEOX)
    with caplog.at_level(logging.WARNING, logger="verl_hpc.resharding.bridge"):
        assert rollout_slicer("auto", str(folders["starcoder2"]), 2) is None
    assert "Transformers modelling backend" in caplog.text
    with pytest.raises(PlanError, match="resharding.mode=sliced: vLLM's Transformers modelling backend"):
        rollout_slicer("sliced", str(folders["starcoder2"]), 2)
