"""The pad token's embedding row on both engines (engines/fsdp/build.py, train_pad_row): a tiny
SmolLM2-class Llama (tied embeddings) whose pad_token_id is a token that occurs in the prompts, as
SmolLM2's `<|im_end|>` does in every chat prompt. transformers builds its embedding with
`padding_idx`, which zeroes that row's gradient; the Megatron engine trains it. One behaviour for
both: the row trains. One update on each engine: every tensor within 1e-5 (on 85ec11b that row
differed by ~1e-2 at lr 0.5), and the pad row moved on both."""
import json

import pytest
import torch

from engine_states import engine, make_batch, one_rank_world, update

PAD = 7  # a token the prompts hold


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import cpu_compat, destroy_model_parallel, init_model_parallel

    tmp = tmp_path_factory.mktemp("pad_row")
    folder = make_tiny_model(tmp / "smol", "llama", tied=True, layers=2, seed=3)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, pad_token_id=PAD)))
    with one_rank_world(tmp / "world"):
        init_model_parallel(1, 1)
        try:
            yield folder
        finally:
            destroy_model_parallel()
            cpu_compat.revert()


def _embedding(eng) -> torch.Tensor:
    for name, t in eng.export_hf_weights():
        if name == "model.embed_tokens.weight":
            return t.detach().clone()
    raise AssertionError("no model.embed_tokens.weight exported")


def test_the_pad_row_trains_alike_on_both_engines(world):
    from safetensors.torch import load_file

    batch = make_batch(4)
    batch["input_ids"][:, 1] = PAD  # every prompt (2-8 tokens) holds the pad token at position 1
    start = load_file(str(world / "model.safetensors"))["model.embed_tokens.weight"]
    got = {}
    for kind in ("fsdp", "megatron"):
        eng = engine(kind, world)
        update(eng, batch)
        got[kind] = {n: t.detach().clone() for n, t in eng.export_hf_weights()}
        del eng
    fsdp, meg = got["fsdp"], got["megatron"]
    assert sorted(fsdp) == sorted(meg)
    assert max(float((fsdp[n] - meg[n]).abs().max()) for n in fsdp) <= 1e-5
    for weights in (fsdp, meg):
        assert float((weights["model.embed_tokens.weight"][PAD] - start[PAD]).abs().max()) > 1e-3
