"""Megatron context parallelism's split and reassembly (engines/megatron/context_parallel.py)
against plain references: Megatron-Core's own split helper, a hand-written chunk rule, identity of
split-then-reassemble, and the causal attention work per rank."""
import pytest
import torch

from verl_hpc.engines.megatron import context_parallel as cpl

CASES = [(cp, n) for cp in (1, 2, 3, 4, 8) for n in (2 * cp, 4 * cp, 6 * cp * 5)]


def plain_tokens(seq_len, cp, rank):
    """The rule in words: 2 * cp equal chunks, rank r takes chunk r then chunk 2 * cp - 1 - r."""
    c = seq_len // (2 * cp)
    return list(range(rank * c, rank * c + c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


@pytest.mark.parametrize("cp, n", CASES)
def test_each_rank_holds_the_chunks_the_rule_names(cp, n):
    held = [cpl.token_index(n, cp, r).tolist() for r in range(cp)]
    assert held == [plain_tokens(n, cp, r) for r in range(cp)]
    assert sorted(sum(held, [])) == list(range(n))  # every token once


@pytest.mark.parametrize("cp, n", CASES)
def test_split_then_reassemble_is_the_identity(cp, n):
    g = torch.Generator().manual_seed(cp * 1000 + n)
    for shape in ((3, n), (2, n, 5)):  # [B, T] log-probs / entropy, and a trailing dim (values [b, s, 1])
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        parts = [x.index_select(1, cpl.token_index(n, cp, r)) for r in range(cp)]
        assert torch.equal(cpl.reassemble(parts), x)


class _Group:
    """What Megatron's helper asks of a process group: its size and this rank's place."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_split_is_megatron_cores_own(one_rank_world, cp):
    n = 12 * cp
    ids = torch.arange(2 * n).view(2, n) + 100
    pos = torch.arange(n).unsqueeze(0).expand(2, n)
    for r in range(cp):
        mine = cpl.split_for_rank({"input_ids": ids, "position_ids": pos, "labels": ids + 1, "attention_mask": None},
                                  _Group(cp, r))
        want = torch.tensor(plain_tokens(n, cp, r))
        assert torch.equal(mine["input_ids"], ids[:, want])
        assert torch.equal(mine["position_ids"], pos[:, want])  # each rank's positions: its tokens' own
        assert torch.equal(mine["labels"], ids[:, want] + 1)
        assert mine["attention_mask"] is None


def test_a_length_that_does_not_split_is_refused(one_rank_world):
    with pytest.raises(ValueError, match=r"sequence length 10 is not a multiple of 2 \* cp = 4"):
        cpl.split_for_rank({"input_ids": torch.zeros(1, 10, dtype=torch.long)}, _Group(2, 0))
    with pytest.raises(ValueError, match="not a multiple of 2 \\* cp = 6"):
        cpl.token_index(8, 3, 0)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_balances(cp):
    n = 2 * cp * 64
    pairs = [cpl.causal_pairs(n, cp, r) for r in range(cp)]
    assert len(set(pairs)) == 1  # equal to the pair
    assert sum(pairs) == n * (n + 1) // 2  # the whole causal triangle
    # a contiguous split of cp chunks would load the last rank far more than the first
    contiguous = [sum(range(r * n // cp + 1, (r + 1) * n // cp + 1)) for r in range(cp)]
    assert max(contiguous) > 2 * min(contiguous)


def test_gather_on_one_rank_is_the_input(one_rank_world):
    import torch.distributed as dist

    x = torch.randn(2, 8)
    assert cpl.gather_sequence(x, dist.group.WORLD) is x


def test_engine_refuses_cp_without_transformer_engine(monkeypatch):
    from verl_hpc.config.errors import ConfigError
    from verl_hpc.engines.megatron import build

    build.check_context_parallel(1)  # nothing to refuse
    with pytest.raises(ConfigError) as info:
        build.check_context_parallel(2)  # this CPU node
    assert str(info.value) == ("parallel.cp = 2 needs Transformer Engine's attention (TEDotProductAttention) on a "
                               "CUDA GPU, and this node has no CUDA GPU; install the 'gpu' extra or set parallel.cp=1")
    monkeypatch.setattr(build, "has_gpu", lambda: True)  # a GPU node without TE
    monkeypatch.setattr(build, "transformer_engine_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^parallel.cp = 4 needs .* and Transformer Engine is not installed; "):
        build.check_context_parallel(4)
    monkeypatch.setattr(build, "transformer_engine_available", lambda: True)
    build.check_context_parallel(4)
