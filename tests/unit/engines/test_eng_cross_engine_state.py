"""The two engines' states cross both ways where the 2-rank chain (tests/dist/checkpoint/
test_ckpt_cross_engine.py, an untied Qwen2 actor) does not go: a model with tied embeddings (no
output layer saved by either engine) and a critic's value head (HF `score.weight`, Megatron's
`value_head.weight`). One gloo rank; each hop loads a checkpoint and saves again at once, and the
two checkpoints must hold the same tensors, bitwise."""
import gc

import pytest
import torch

from engine_states import engine, load, make_batch, one_rank_world, save, update
from jobs import read_all


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder holding the two tiny models, in a one-rank world with Megatron's parallel state."""
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import cpu_compat, destroy_model_parallel, init_model_parallel

    tmp = tmp_path_factory.mktemp("cross_engine_state")
    make_tiny_model(tmp / "qwen2_tied", "qwen2", tied=True, layers=2, seed=6)
    make_tiny_model(tmp / "llama", "llama", layers=2, seed=7)
    with one_rank_world(tmp / "world"):
        init_model_parallel(1, 1)
        try:
            yield tmp
        finally:
            destroy_model_parallel()
            cpu_compat.revert()


def _same(a, b) -> list:
    ta, tb = read_all(a), read_all(b)
    assert ta, a
    return sorted(set(ta) ^ set(tb)) + [n for n in sorted(set(ta) & set(tb)) if not torch.equal(ta[n], tb[n])]


def _hop(kind, folder, src, dst, step, **head):
    """A fresh engine of `kind` loads `src`, saves `dst` at once; the engine (to go on with)."""
    eng = engine(kind, folder, **head)
    load(eng, src / f"step_{step:06d}")
    save(eng, dst, step, {kind: 1})
    return eng


@pytest.mark.heavy
def test_tied_embeddings_cross_both_ways_bitwise(world):
    folder = world / "qwen2_tied"
    eng = engine("fsdp", folder)
    update(eng, make_batch(1))
    save(eng, world / "A", 1, {"fsdp": 1})
    del eng
    eng = _hop("megatron", folder, world / "A", world / "B", 1)  # FSDP -> Megatron
    assert _same(world / "A", world / "B") == []
    update(eng, make_batch(2))
    save(eng, world / "C", 2, {"megatron": 1})
    del eng
    _hop("fsdp", folder, world / "C", world / "D", 2)  # Megatron -> FSDP
    assert _same(world / "C", world / "D") == []
    names = read_all(world / "D")
    assert "actor/model/embedding.word_embeddings.weight" in names
    assert not any("output_layer" in n for n in names)  # tied: the embedding, once
    gc.collect()


def test_value_head_crosses_both_ways_bitwise(world):
    folder = world / "llama"
    critic = {"head": "value"}
    eng = engine("megatron", folder, **critic)
    save(eng, world / "V1", 1, {"megatron": 1})
    del eng
    _hop("fsdp", folder, world / "V1", world / "V2", 1, **critic)  # Megatron -> FSDP
    assert _same(world / "V1", world / "V2") == []
    _hop("megatron", folder, world / "V2", world / "V3", 1, **critic)  # and back
    assert _same(world / "V2", world / "V3") == []
    assert read_all(world / "V3")["actor/model/value_head.weight"].shape == (1, 128)
    gc.collect()
