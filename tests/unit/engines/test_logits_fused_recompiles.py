"""The compiled chunk body (engines/logits_fused.py) across token counts (issue 85, suspect 7):
every micro-batch of a job scores its own number of tokens, so each count is a new shape for the
three compiled functions. Compiled with static shapes they made three graphs per new count until
torch's recompile limit, then ran eagerly; with automatic dynamic shapes the second count compiles
symbolic graphs that every later count reuses. Counted with a counting backend (no compiler)."""
import pytest
import torch


@pytest.fixture
def counted(monkeypatch):
    from torch._dynamo.testing import CompileCounter

    from verl_hpc.engines import logits_fused

    counter = CompileCounter()
    monkeypatch.setattr(logits_fused, "COMPILE", True)
    monkeypatch.setattr(logits_fused, "BACKEND", counter)
    logits_fused._compile.cache_clear()
    torch._dynamo.reset()
    yield counter
    logits_fused._compile.cache_clear()
    torch._dynamo.reset()


def test_new_token_counts_stop_making_graphs(counted):
    from verl_hpc.engines.logits import token_outputs

    g = torch.Generator().manual_seed(0)
    weight = (0.3 * torch.randn(64, 8, generator=g)).requires_grad_()
    graphs = []
    for n in (40, 56, 72, 88, 104):  # one chunk each, of a size not seen before
        hidden = torch.randn(n, 8, generator=g).requires_grad_()
        targets = torch.randint(0, 64, (n,), generator=g)
        out = token_outputs(hidden, weight, targets, ("log_probs", "entropy"), chunk=1024, fused=True)
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
        graphs.append(counted.frame_count)
    assert graphs[0] == 3  # max, sums, gradient
    assert graphs[1] <= 6 and graphs[2:] == [graphs[1]] * 3, graphs
