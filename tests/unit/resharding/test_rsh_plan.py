"""The sliced sync's plan (pure: no ranks) and the delta codec, against hand-derived layouts.

The tiny model's shapes: hidden 128, 4 heads of 32 in 2 KV groups, ffn 256, vocabulary 500
(vLLM pads it to 512 before its TP split; Megatron to 512 at TP 1 and 2)."""
import pytest
import torch

from verl_hpc.resharding import delta as codec
from verl_hpc.resharding.plan import Holding, Need, PlanError, RolloutSlicer, SyncPlan, _cover

L0 = "model.layers.0."
SHAPES = {"model.embed_tokens.weight": (500, 128), L0 + "input_layernorm.weight": (128,),
          L0 + "self_attn.q_proj.weight": (128, 128), L0 + "self_attn.k_proj.weight": (64, 128),
          L0 + "self_attn.v_proj.weight": (64, 128), L0 + "self_attn.q_proj.bias": (128,),
          L0 + "self_attn.o_proj.weight": (128, 128), L0 + "mlp.gate_proj.weight": (256, 128),
          L0 + "mlp.up_proj.weight": (256, 128), L0 + "mlp.down_proj.weight": (128, 256),
          "model.norm.weight": (128,), "lm_head.weight": (500, 128)}


def slicer(tp):
    return RolloutSlicer(tp, head_dim=32, vocab_size=500)


def test_rollout_slices_follow_vllm_cuts():
    s2, s4 = slicer(2), slicer(4)
    assert s2.need(L0 + "self_attn.q_proj.weight", (128, 128), 1) == (0, 64, 128)
    assert s2.need(L0 + "self_attn.q_proj.bias", (128,), 1) == (0, 64, 128)
    assert s2.need(L0 + "self_attn.k_proj.weight", (64, 128), 1) == (0, 32, 64)
    # 2 KV heads over 4 ranks: ranks 0,1 keep head 0, ranks 2,3 head 1 (vLLM replicates)
    assert [s4.need(L0 + "self_attn.v_proj.weight", (64, 128), r) for r in range(4)] == [
        (0, 0, 32), (0, 0, 32), (0, 32, 64), (0, 32, 64)]
    assert s2.need(L0 + "self_attn.o_proj.weight", (128, 128), 0) == (1, 0, 64)
    assert s2.need(L0 + "mlp.down_proj.weight", (128, 256), 1) == (1, 128, 256)
    assert s2.need(L0 + "mlp.up_proj.weight", (256, 128), 1) == (0, 128, 256)
    assert s2.need("model.norm.weight", (128,), 1) == (0, 0, 128)
    # vocabulary 500 -> 512 padded: 256 rows per rank at TP 2, the last rank's real part ends at 500
    assert s2.need("model.embed_tokens.weight", (500, 128), 1) == (0, 256, 500)
    assert [s4.need("lm_head.weight", (500, 128), r) for r in range(4)] == [
        (0, 0, 128), (0, 128, 256), (0, 256, 384), (0, 384, 500)]
    assert slicer(1).need(L0 + "mlp.down_proj.weight", (128, 256), 0) == (0, 0, 128)  # whole


def test_impossible_inference_tp_names_the_tensor():
    with pytest.raises(PlanError, match="q_proj.weight.*inference TP 3"):
        slicer(3).need(L0 + "self_attn.q_proj.weight", (128, 128), 0)
    with pytest.raises(PlanError, match="no rule"):
        slicer(2).need("model.vision_tower.proj", (8, 8), 0)


def train_tp2_holdings(dp=2):
    """Megatron TP 2 x DP `dp` over ranks [tp rank + 2 * dp rank]: what each holds, in HF terms."""
    out = []
    for d in range(dp):
        for t in range(2):
            r = 2 * d + t
            for hf, shape in SHAPES.items():
                if len(shape) == 1 and "bias" not in hf:
                    out.append(Holding(r, hf, None, 0, 0, d))
                elif "o_proj" in hf or "down_proj" in hf:
                    half = shape[1] // 2
                    out.append(Holding(r, hf, 1, t * half, (t + 1) * half, d))
                elif hf in ("model.embed_tokens.weight", "lm_head.weight"):  # 512 padded: 256 a rank
                    out.append(Holding(r, hf, 0, 256 * t, min(256 * (t + 1), 500), d))
                else:
                    half = shape[0] // 2
                    out.append(Holding(r, hf, 0, t * half, (t + 1) * half, d))
    return out


def needs_for(world, tp, dp_of):
    s = slicer(tp)
    return [Need(r, hf, *s.need(hf, shape, r % tp), dp_of(r)) for r in range(world) for hf, shape in SHAPES.items()]


def build(rank, needs, holdings=None, bucket_bytes=1 << 30):
    return SyncPlan.build(rank, list(SHAPES), SHAPES, holdings or train_tp2_holdings(), needs,
                          element_size=4, bucket_bytes=bucket_bytes)


def test_train_tp2_to_inference_tp1_takes_the_other_half_from_its_own_replica():
    needs = needs_for(4, 1, lambda r: r // 2)
    q = [t for t in _cover(next(n for n in needs if n.rank == 2 and n.hf.endswith("q_proj.weight")),
                           [h for h in train_tp2_holdings() if h.hf.endswith("q_proj.weight")], (128, 128))]
    assert [(t.src, t.dim, t.start, t.stop) for t in q] == [(2, 0, 0, 64), (3, 0, 64, 128)]
    o = _cover(next(n for n in needs if n.rank == 0 and "o_proj" in n.hf),
               [h for h in train_tp2_holdings() if "o_proj" in h.hf], (128, 128))
    assert [(t.src, t.dim, t.start, t.stop) for t in o] == [(0, 1, 0, 64), (1, 1, 64, 128)]
    norm = _cover(next(n for n in needs if n.rank == 3 and n.hf == "model.norm.weight"),
                  [h for h in train_tp2_holdings() if h.hf == "model.norm.weight"], (128,))
    assert [(t.src, t.start, t.stop) for t in norm] == [(3, 0, 128)]  # its own copy: no wire


def test_same_tp_on_both_sides_is_all_local():
    needs = needs_for(4, 2, lambda r: r // 2)
    for rank in range(4):
        plan = build(rank, needs)
        rows = [t for b in plan.transfers.values() for t in b]
        assert rows and all(t.src == t.dst == rank for t in rows)


def test_every_rank_receives_exactly_its_slices_once():
    for tp in (1, 2, 4):
        needs = needs_for(4, tp, lambda r: r // 2)
        for rank in range(4):
            plan = build(rank, needs)
            hits = {hf: torch.zeros(shape, dtype=torch.int32) for hf, shape in SHAPES.items()}
            for rows in plan.transfers.values():
                for t in rows:
                    if t.dst == rank:
                        hits[t.hf].narrow(t.dim, t.start, t.stop - t.start).add_(1)
            want = 0
            for hf, shape in SHAPES.items():
                dim, lo, hi = slicer(tp).need(hf, shape, rank % tp)
                expected = torch.zeros(shape, dtype=torch.int32)
                expected.narrow(dim, lo, hi - lo).fill_(1)
                assert torch.equal(hits[hf], expected), (tp, rank, hf)
                want += int(expected.sum())
            assert plan.received_elements() == want, (tp, rank)


def test_buckets_are_the_same_on_every_rank_and_bounded():
    needs = needs_for(4, 2, lambda r: r // 2)
    plans = [build(r, needs, bucket_bytes=70_000) for r in range(4)]
    assert all(p.buckets == plans[0].buckets for p in plans)
    for members in plans[0].buckets:  # a bucket passes the bound only when it is one tensor
        total = sum(torch.Size(SHAPES[plans[0].order[i]]).numel() * 4 for i in members)
        assert total <= 70_000 or len(members) == 1
    assert sorted(i for b in plans[0].buckets for i in b) == list(range(len(SHAPES)))


def test_a_tensor_nobody_holds_is_a_plan_error():
    holdings = [h for h in train_tp2_holdings() if h.hf != "model.norm.weight"]
    with pytest.raises(PlanError, match="model.norm.weight"):
        build(0, needs_for(4, 2, lambda r: r // 2), holdings)


# ----------------------------------------------------------------------------- the delta codec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("frac,mode", [(0.0, codec.INDEX), (0.01, codec.INDEX), (0.2, codec.BITMAP),
                                       (1.0, codec.DENSE)])
def test_codec_round_trips_bitwise_and_never_costs_more_than_dense(dtype, frac, mode):
    g = torch.Generator().manual_seed(1)
    prev = torch.randn(4001, generator=g).to(dtype)
    new = prev.clone()
    new[torch.rand(4001, generator=g) < frac] += 0.25
    new[7] = -0.0 if prev[7] == 0 else new[7]
    got_mode, count, payload = codec.encode(new, prev)
    assert got_mode == mode
    assert count == int((codec.bits(new) != codec.bits(prev)).sum())
    assert payload.numel() == codec.payload_bytes(got_mode, count, 4001, new.element_size())
    assert payload.numel() <= 4001 * new.element_size()
    out = prev.clone()
    unaligned = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])[3:]  # any offset of a bucket
    codec.decode(got_mode, count, unaligned, out)
    assert torch.equal(codec.bits(out), codec.bits(new))
    assert codec.checksum(out) == codec.checksum(new)


def test_codec_sees_sign_of_zero_and_nan_payloads():
    prev = torch.tensor([0.0, float("nan"), 1.0])
    new = torch.tensor([-0.0, float("nan"), 1.0])
    new.view(torch.int32)[1] += 1  # another NaN payload
    mode, count, _ = codec.encode(new, prev)
    assert count == 2


@pytest.mark.parametrize("fn", [codec.checksum, codec.weighted_sum], ids=["host-crc32", "device-sum"])
def test_checksum_changes_with_any_single_element(fn, monkeypatch):
    monkeypatch.setattr(codec, "CHUNK", 300)  # several chunks of the device sum
    t = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    base = fn(t)
    for i in (0, 1, 500, 999):
        for bit in (1, 1 << 15):  # the lowest and the sign bit of one element
            u = t.clone()
            codec.bits(u)[i] ^= bit
            assert fn(u) != base, (i, bit)
    assert fn(t.clone()) == base


@pytest.mark.gpu
def test_codec_and_device_checksum_on_a_gpu():
    """On a GPU the delta codec runs where the weights are, and both sides of a transfer use the
    device checksum: it must see what the host's sees, bit for bit."""
    g = torch.Generator().manual_seed(3)
    prev = torch.randn(100_003, generator=g).to(torch.bfloat16)
    new = prev.clone()
    new[torch.rand(100_003, generator=g) < 0.03] += 0.25
    on = torch.device("cuda")
    mode, count, payload = codec.encode(new.to(on), prev.to(on))
    assert payload.is_cuda and count == int((codec.bits(new) != codec.bits(prev)).sum())
    out = prev.to(on)
    codec.decode(mode, count, payload, out)
    assert torch.equal(out.cpu(), new)
    assert codec.checksum(out) == codec.weighted_sum(new)  # device path == the same sum on the host
    assert codec.checksum(out) != codec.weighted_sum(prev)
