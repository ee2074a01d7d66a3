"""The GPU defaults overlap_grad_reduce and overlap_param_gather (engines/megatron/kernels.py) run on
gloo: at data parallel 2 with the distributed optimizer, two steps give every rank the same weights
as the same steps without them, bitwise, and the engine's parameters() forces the gather a step
leaves to the next forward (read without it, the other rank's shard is stale)."""
import pytest
import torch

from rank_launcher import launch_ranks

pytestmark = pytest.mark.no_vllm("the training engine's communication overlap: no rollout")

SCRIPT = __import__("pathlib").Path(__file__).with_name("overlap_ranks.py")


def test_overlapped_reduce_and_gather_train_the_same_weights_at_dp2(tmp_path):
    from verl_hpc.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "llama", layers=2)
    ranks = launch_ranks(SCRIPT, 2, {"model": str(model)}, tmp_path / "run", timeout=300, what="overlap scenario")
    for rank, rec in enumerate(ranks):
        assert rec["dp"] == 2
        assert rec["perf.False"] == [True, False, False] and rec["perf.True"] == [True, True, True]
        assert rec["loss.False"] == rec["loss.True"]
        assert rec["stale_differs.True"] and not rec["stale_differs.False"]
    params = {(o, r): torch.load(tmp_path / "run" / f"params.{o}.rank{r}.pt") for o in (False, True) for r in (0, 1)}
    assert torch.equal(params[(False, 0)], params[(True, 0)])
    assert torch.equal(params[(False, 0)], params[(False, 1)]) and torch.equal(params[(True, 0)], params[(True, 1)])
