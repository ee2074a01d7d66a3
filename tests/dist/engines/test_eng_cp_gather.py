"""Context parallelism's reassembly through a real Megatron CP group (2 gloo ranks, cp 2): each
rank's share of a sequence is the chunks Megatron's rule names, the gathered result equals the
unsplit batch on every rank, the backward gives each rank its own tokens' gradient once (their sum
over the group is the whole gradient, as DDP's dp x cp reduction adds it), and the gradient group
spans the CP ranks; the engine's CP output path (micro-batch split, per-token log-probs /
entropy / values on each rank's tokens, gather) equals the whole-sequence path in values and in
gradients summed over the group; the engine at cp 2 is refused on this CPU node with one line, before
any weight is built (cp_ranks.py)."""
import pytest
import torch

from cp_ranks import __file__ as SCRIPT
from rank_launcher import launch_ranks
from verl_hpc.engines.megatron.context_parallel import token_index

pytestmark = pytest.mark.no_vllm("the training engine's context-parallel gather: no rollout")

CP, B, S = 2, 3, 16


def test_gather_through_the_cp_group(tmp_path):
    ranks = launch_ranks(SCRIPT, CP, {"cp": CP, "batch": B, "seq": S}, tmp_path, timeout=120,
                         what="context-parallel gather")
    x = torch.arange(B * S, dtype=torch.float64).view(B, S) * 0.5 + 1.0
    weights = torch.linspace(-1.0, 1.0, B * S, dtype=torch.float64).view(B, S)
    whole_grad = torch.zeros(B, S, dtype=torch.float64)
    for r in ranks:
        assert (r["cp"], r["dp"], r["dp_cp"]) == (CP, 1, CP)  # DDP's gradient group is dp x cp
        idx = token_index(S, CP, r["cp_rank"])
        assert idx.tolist() == list(range(4 * r["cp_rank"], 4 * r["cp_rank"] + 4)) + \
            list(range(4 * (3 - r["cp_rank"]), 4 * (4 - r["cp_rank"])))
        assert torch.equal(torch.tensor(r["local"], dtype=torch.float64), x[:, idx])
        assert r["gathered_equal"]
        assert torch.equal(torch.tensor(r["grad"]), torch.tensor(r["want_grad"]))
        whole_grad[:, idx] += torch.tensor(r["grad"], dtype=torch.float64)
    assert sorted(r["cp_rank"] for r in ranks) == [0, 1]
    # the engine's output path at cp 2 = the whole-sequence path (values exactly; gradients to float32
    # rounding: the entropy is float32 on both paths)
    for r in ranks:
        o = r["outputs"]
        assert o["shape_equal"] and o["labels_split"]
        for kind in ("lm", "labels", "value"):
            assert o[kind]["value"] < 1e-12, (kind, o[kind])
            assert o[kind]["grad_scale"] > 0 and o[kind]["grad"] < 1e-6 * o[kind]["grad_scale"], (kind, o[kind])
    for r in ranks:  # the engine at cp 2 on a CPU node: one line, before any weight is built
        assert r["refusal"] == {"type": "ConfigError", "built": False, "message": (
            "parallel.cp = 2 needs Transformer Engine's attention (TEDotProductAttention) on a CUDA GPU, and "
            "this node has no CUDA GPU; install the 'gpu' extra or set parallel.cp=1")}
    assert torch.equal(whole_grad, weights)  # each token's gradient once, not cp times
