"""Split placement's sliced publish without the network: the snapshot's buckets cut for each
rollout rank (slice_buffer) and read back on that rank (slices_in) give exactly vLLM's slice of
every tensor, and each rank's bytes are its shard; the exchange itself runs in the split-placement
job tests (tests/dist/trainer/test_split_async.py)."""
import pytest
import torch

from verl_hpc.resharding.bridge import pack, slice_buffer, slice_manifest, slices_in
from verl_hpc.resharding.plan import RolloutSlicer

from test_rsh_plan import SHAPES  # the tiny model's HF tensors


@pytest.mark.parametrize("tp,ranks", [(1, 1), (2, 2), (4, 4), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_rollout_rank_gets_exactly_its_slices(tp, ranks, dtype):
    g = torch.Generator().manual_seed(tp * 10 + ranks)
    full = {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}
    buckets, manifest = pack(full.items(), 200_000)  # several buckets
    assert len(buckets) > 2
    slicer = RolloutSlicer(tp, head_dim=32, vocab_size=500)
    sizes, rows = slice_manifest(manifest, slicer, ranks)
    per_rank = {r: {} for r in range(ranks)}
    for b, bucket in enumerate(buckets):
        send = slice_buffer(bucket, b, manifest, (sizes, rows))
        start = 0
        for r in range(ranks):  # what the exchange hands each rank: its part of the send buffer
            mine = send[start:start + sizes[r][b]].clone()
            start += sizes[r][b]
            for name, part, need in slices_in(mine, [row for row in rows[r] if row[3] == b], r):
                per_rank[r][name] = (part.clone(), need)
    for r in range(ranks):
        assert set(per_rank[r]) == set(SHAPES)
        elements = 0
        for name, (part, need) in per_rank[r].items():
            dim, lo, hi = slicer.need(name, SHAPES[name], r % tp)
            assert (need.dim, need.start, need.stop) == (dim, lo, hi)
            assert torch.equal(part, full[name].narrow(dim, lo, hi - lo)), (tp, r, name)
            elements += part.numel()
        if tp > 1:  # a rank receives its shard, not the model
            assert elements < 0.6 * sum(t.numel() for t in full.values())
