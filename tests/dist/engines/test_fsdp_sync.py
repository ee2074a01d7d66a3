"""The sliced weight sync from FSDP shards on 2 ranks (fsdp_sync_ranks.py): at inference TP 1 every
rollout rank receives exactly its slices, bitwise those of the full export, under plain FSDP and
HSDP, before and after an update (with delta), and data really crosses ranks under FSDP (each
rank holds half of every tensor's rows) but not under HSDP at shard size 1 (each rank holds a
replica). At inference TP 2 vLLM cuts o_proj and down_proj by columns, which row shards cannot
serve slice by slice under plain FSDP: resharding.mode=auto takes the full-tensor path there,
without an error (under HSDP at shard size 1 every rank holds whole tensors and TP 2 is sliced)."""
import pytest

from fsdp_sync_ranks import launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("fsdp_sync")
    model = str(make_tiny_model(root / "qwen2", "qwen2", layers=2))  # qkv bias, untied
    return launch(2, dict(model=model), root / "ranks")


def test_every_slice_is_bitwise_the_full_exports(ranks):
    for r in ranks:
        assert len(r) == 8
        for case, got in r.items():
            if case.startswith("shard0/tp2/"):
                assert got["sliced"] == 0.0, case  # the full path
            else:  # TP 1, or whole tensors on every rank (HSDP at shard size 1): sliced
                assert got["mismatches"] == [], case
                assert got["sliced"] == 1.0, case


def test_slices_cross_ranks_under_fsdp_and_come_from_the_own_replica_under_hsdp(ranks):
    for r in ranks:
        # plain FSDP: each rank holds half the rows, so a TP-1 rollout rank receives the other half
        assert r["shard0/tp1/start"]["wire"] > 0
        # HSDP with shard size 1: every rank holds a whole replica, nothing crosses
        assert r["shard1/tp1/start"]["wire"] == 0
        # delta after an update of a few steps sends no more than dense
        assert r["shard0/tp1/after_update"]["bytes"] <= r["shard0/tp1/after_update"]["dense"]
