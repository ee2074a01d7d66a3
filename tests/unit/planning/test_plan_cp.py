"""The memory plan under context parallelism (parallel.cp): a rank's activations and logits are
those of 1/cp of each row; the distributed optimizer shards over dp x cp, so the model states per
rank do not change; the plan says so in a note."""
from pathlib import Path

import pytest

from verl_hpc.config import load_config
from verl_hpc.planning import plan_job
from verl_hpc.planning.training import cp_tokens

GRPO = str(Path(__file__).resolve().parents[3] / "configs/grpo_8b.yaml")


def test_a_rank_holds_two_chunks_of_the_padded_row():
    assert cp_tokens(4096, 1) == 4096 and cp_tokens(4097, 1) == 4097
    assert cp_tokens(4096, 2) == 2048 and cp_tokens(4096, 8) == 512
    assert cp_tokens(4097, 2) == 2050  # padded to 4100 = 4 chunks of 1025, two of them per rank


@pytest.mark.parametrize("cp", [2, 4])
def test_activations_and_logits_divide_by_cp(cp):
    # whole logits on both sides: context parallelism keeps them (the chunked output layer is cp 1's)
    one = plan_job(load_config(GRPO, ["slurm.tasks_per_node=8", "model.logits_chunk_tokens=0"]), stage=0)
    split = plan_job(load_config(GRPO, [f"parallel.cp={cp}", "model.logits_chunk_tokens=0"]), stage=0)
    for phase in ("update_actor", "old_logprob"):
        for part in ("activations", "logits"):
            a, b = one.table[phase][part], split.table[phase][part]
            assert a > 0 and b == pytest.approx(a / cp, rel=0.02), (phase, part, a, b)
    # the same optimizer shard per rank: dp halves, the dp x cp group it shards over does not
    assert split.table["update_actor"]["actor"] == pytest.approx(one.table["update_actor"]["actor"], rel=1e-9)
    note = [n for n in split.notes if n.startswith(f"context parallel {cp}:")]
    assert len(note) == 1 and f"holds {4096 // cp} of a 4096-token row" in note[0]
    assert not [n for n in one.notes if n.startswith("context parallel")]
