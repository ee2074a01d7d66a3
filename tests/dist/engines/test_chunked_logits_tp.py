"""The chunked output layer (verl_hpc/engines/logits.py) on 2 gloo ranks (chunk_ranks.py): under
Megatron's tensor parallelism 2 (each rank scores its vocabulary slice, max and sums all-reduced,
the padded rows of the vocabulary on rank 1 sliced off), FSDP over 2 ranks, and Ulysses sequence
parallelism 2, with temperature and packed rows: chunks of 5 tokens give the forward's log-probs,
entropy and sum-pi-squared, the update's weights and metrics of the whole logits
(model.logits_chunk_tokens = 0) within EXACT, relative to the largest magnitude compared.
"""
import pytest
import torch

from chunk_ranks import CASES, launch
from engine_states import grpo_policy_batch
from update_reference import max_diff, policy_batch

pytestmark = pytest.mark.no_vllm("the training engines' chunked logits: no rollout")

EXACT = 1e-6
ACTOR = dict(ppo_mini_batch_size=8, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("chunked_tp")
    folders = {"llama": make_tiny_model(root / "llama", "llama", layers=2),
               "qwen2": make_tiny_model(root / "qwen2", "qwen2", tied=True, layers=2, seed=1)}
    work = root / "ranks"
    work.mkdir()
    torch.save({"plain": policy_batch(8), "grouped": grpo_policy_batch(seed=7)}, work / "batch.pt")
    args = dict(models={k: str(v) for k, v in folders.items()}, actor=ACTOR,
                optim=dict(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.01))
    return work, launch(args, work)


def _close(got, want, what):
    scale = max(1.0, float(want.abs().max()))
    assert float((got - want).abs().max()) <= EXACT * scale, what


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_equal_the_whole_logits_on_two_ranks(run, case):
    work, ranks = run
    a, b = (torch.load(work / f"{case}.chunk{k}.pt") for k in (5, 0))
    for key in ("log_probs", "entropy", "sum_pi_squared"):
        _close(a["out"][key], b["out"][key], key)
    assert float(b["out"]["entropy"].abs().max()) > 1.0
    assert max_diff(a["weights"], b["weights"]) <= EXACT
    for r in ranks:
        ma, mb = (r["checks"][f"{case}.chunk{k}"]["metrics"] for k in (5, 0))
        for key in ("actor/loss", "actor/entropy_loss", "actor/grad_norm"):
            assert ma[key] == pytest.approx(mb[key], rel=EXACT, abs=EXACT), key
        if CASES[case]["share"] == "on":
            assert ma["actor/packed_microbatches"] > 0
