"""Engine state slabs are layout independent: TP shards (fused gate/up, padded vocabulary,
row-parallel weights) and distributed-optimizer flat ranges map back onto the same logical
tensors at any split (verl_hpc.engines.megatron.state)."""
import types

import pytest
import torch

from verl_hpc.engines.megatron.state import _box_slabs, _flat_slabs, param_pieces

H, F, V_REAL = 4, 6, 5


def _gpt(tied=False):
    layers = [types.SimpleNamespace(layer_number=3)]  # stage-local layer 0 is global layer 2
    return types.SimpleNamespace(verl_arch=types.SimpleNamespace(vocab_size=V_REAL, tie_word_embeddings=tied),
                                 config=types.SimpleNamespace(gated_linear_unit=True),
                                 decoder=types.SimpleNamespace(layers=layers))


def _param(t, dim=None):
    if dim is not None:
        t.tensor_model_parallel, t.partition_dim = True, dim
    return t


def _shards(tp, v_pad):
    """Megatron's per-rank shards of one layer's fc1 and linear_proj and the embedding (its
    vocabulary padded to v_pad rows)."""
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(F, H, generator=g), torch.randn(F, H, generator=g)
    proj, emb = torch.randn(H, F, generator=g), torch.randn(V_REAL, H, generator=g)
    emb_pad = torch.cat([emb, torch.zeros(v_pad - V_REAL, H)])
    f, c, v = F // tp, F // tp, v_pad // tp
    per_rank = []
    for r in range(tp):
        per_rank.append({
            "decoder.layers.0.mlp.linear_fc1.weight": _param(torch.cat([gate[r * f:(r + 1) * f], up[r * f:(r + 1) * f]]), 0),
            "decoder.layers.0.self_attention.linear_proj.weight": _param(proj[:, r * c:(r + 1) * c].clone(), 1),
            "embedding.word_embeddings.weight": _param(emb_pad[r * v:(r + 1) * v].clone(), 0),
        })
    logical = {"decoder.layers.2.mlp.linear_fc1.weight/gate": gate, "decoder.layers.2.mlp.linear_fc1.weight/up": up,
               "decoder.layers.2.self_attention.linear_proj.weight": proj, "embedding.word_embeddings.weight": emb}
    return per_rank, logical


def _assemble(slabs):
    out = {}
    for s in slabs:
        full = out.setdefault(s.name, torch.full(tuple(s.global_shape), float("nan")))
        full[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.local.shape))] = s.local
    return out


@pytest.mark.parametrize("tp, v_pad", [(1, 8), (2, 8), (3, 6)])
def test_tp_shards_map_onto_the_logical_tensors(tp, v_pad):
    per_rank, logical = _shards(tp, v_pad)
    slabs = []
    for r, params in enumerate(per_rank):
        for name, p in params.items():
            pieces, saved = param_pieces(_gpt(), name, p, r, tp, value_head=False)
            assert saved
            slabs += list(_box_slabs("model", pieces, p, (0,) * p.dim()))
    got = _assemble(slabs)
    assert sorted(got) == sorted(f"model/{k}" for k in logical)
    for k, v in logical.items():
        assert torch.equal(got[f"model/{k}"], v), k


@pytest.mark.parametrize("cuts", [[0, 7, 13, 24], [0, 1, 2, 23, 24], [0, 24]])
def test_distributed_optimizer_flat_ranges_map_onto_the_same_tensors(cuts):
    per_rank, logical = _shards(2, 8)
    slabs = []
    for r, params in enumerate(per_rank):
        for name, p in params.items():
            pieces, _ = param_pieces(_gpt(), name, p, r, 2, value_head=False)
            flat = p.reshape(-1)
            bounds = [min(c, flat.numel()) for c in cuts[:-1]] + [flat.numel()]
            for s, e in zip(bounds, bounds[1:]):  # a DP rank's [s, e) of the local shard
                slabs += list(_flat_slabs("optim/exp_avg", pieces, flat[s:e], tuple(p.shape), s, e))
    got = _assemble(slabs)
    for k, v in logical.items():
        assert torch.equal(got[f"optim/exp_avg/{k}"], v), k


def test_tied_output_layer_is_a_load_only_copy_of_the_embedding():
    p = _param(torch.zeros(4, H), 0)  # TP rank 1 of 2 over 8 padded rows
    pieces, saved = param_pieces(_gpt(tied=True), "output_layer.weight", p, 1, 2, value_head=False)
    assert not saved and pieces[0].name == "embedding.word_embeddings.weight"
    assert pieces[0].hi == V_REAL - 4  # padding rows are not part of the tensor


def test_value_head_is_replicated():
    pieces, saved = param_pieces(_gpt(), "output_layer.weight", torch.zeros(1, H), 1, 2, value_head=True)
    assert saved and pieces[0].name == "value_head.weight" and pieces[0].global_shape == (1, H)


def test_value_outputs_align_values_and_scores():
    from verl_hpc.engines.batch import pack_sequences
    from verl_hpc.engines.megatron.schedule import MicroBatch
    from verl_hpc.engines.megatron.outputs import value_outputs

    mb = MicroBatch(pack_sequences([[1, 2], [3]], [[4, 5, 6], [7]]), [0, 1], "cpu", 1)
    v = torch.arange(10, dtype=torch.float32).view(2, 5, 1)  # value at position s = 5 b + s
    out = value_outputs(v, mb.data, ("values", "scores", "token_scores"))
    assert out["values"][0].tolist() == [1.0, 2.0, 3.0]  # positions p + t - 1 = 1, 2, 3
    assert out["values"][1, 0] == 5.0  # row 1: p = 1 -> position 0
    assert out["scores"].tolist() == [4.0, 6.0]  # last tokens: positions 4 and 1
    assert out["token_scores"].tolist() == [[0.0, 0.0, 4.0], [6.0, 0.0, 0.0]]


def test_cp_replicas_are_written_once_and_read_back_at_any_layout():
    """tp 2 x cp 2 (Megatron's rank order: tp fastest, then cp): the CP ranks of a TP rank hold the
    same weight shards, the distributed optimizer shards its states over the dp x cp group. The
    save plan writes each weight once (from CP rank 0), every optimizer range once, and the pieces
    it names are the logical tensors, so a cp 1 (or any) layout reads them back."""
    from verl_hpc.checkpoint.plan import Desc, make_plan, rank_file

    tp, cp = 2, 2
    per_tp, logical = _shards(tp, 8)
    slabs_of = []  # per global rank
    for rank in range(tp * cp):
        tp_rank, cp_rank = rank % tp, rank // tp
        mine = []
        for name, p in per_tp[tp_rank].items():
            pieces, _ = param_pieces(_gpt(), name, p, tp_rank, tp, value_head=False)
            mine += list(_box_slabs("model", pieces, p, (0,) * p.dim()))
            flat = p.reshape(-1)  # the distributed optimizer: this rank's half of its dp x cp group
            s, e = cp_rank * flat.numel() // cp, (cp_rank + 1) * flat.numel() // cp
            mine += list(_flat_slabs("optim/exp_avg", pieces, flat[s:e], tuple(p.shape), s, e))
        slabs_of.append(mine)
    descs = [[Desc(t.name, t.global_shape, "float32", tuple(t.offsets), tuple(t.local.shape), t.local.numel() * 4)
              for t in mine] for mine in slabs_of]
    plan = make_plan(descs)
    written = []
    for rank, writes in enumerate(plan.writes):
        for i, _ in writes:
            written.append((rank, slabs_of[rank][i]))
    model_writers = {r for r, t in written if t.name.startswith("model/")}
    assert model_writers == {0, 1}  # CP rank 0 of each TP rank; its CP replica writes no weight
    assert {r for r, t in written if t.name.startswith("optim/")} == {0, 1, 2, 3}
    got = _assemble([t for _, t in written])
    for k, v in logical.items():
        assert torch.equal(got[f"model/{k}"], v) and torch.equal(got[f"optim/exp_avg/{k}"], v), k
    total = sum(v.numel() for v in logical.values()) * 2  # model + optimizer, each element once
    assert sum(t.local.numel() for _, t in written) == total
    assert all(p["file"] in {rank_file(r) for r in range(tp * cp)} for t in plan.tensors.values() for p in t["pieces"])
