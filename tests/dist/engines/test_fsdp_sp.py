"""Ulysses sequence parallelism on the FSDP engine (`fsdp.sp`, verl_hpc/engines/fsdp/ulysses.py):
4 gloo ranks at sp = 1, 2 and 4 (fsdp_sp_ranks.py) on 4 rows of about 4,000 tokens, for a tiny
Llama with 2 KV heads (at sp 4 each KV head is repeated) and one with a single KV head (fewer than
sp at 2 and 4). sp 2 and sp 4 give sp 1's log-probs and entropy within LOGP_TOL (the engine's
parity bound) and its weights after one update within WEIGHT_TOL, with the same loss and gradient
norm; the wrapped attention is what ran, and the data-parallel size is ranks / sp. A token budget
per micro-batch is per rank: an sp group packs sp times it. sp composes with HSDP (a 2-D mesh).
"""
import pytest
import torch

from fsdp_sp_ranks import SPS, launch
from update_reference import max_diff

pytestmark = pytest.mark.no_vllm("the FSDP engine's sequence parallel: no rollout")

WORLD = 4
LOGP_TOL, WEIGHT_TOL = 2e-5, 1e-5
MODELS = {"llama": dict(kv_heads=2), "gqa1": dict(kv_heads=1, seed=1)}
BUDGET = 4200  # tokens per micro-batch and rank: one ~4k row alone, two per micro-batch of an sp-2 group


def long_batch(seed: int, rows: int = 4, vocab: int = 480):
    """Rows of 3,900-4,100 tokens: prompts of 100-300, responses of the rest, and the policy
    loss's inputs (advantages, old and reference log-probs) on the response tokens."""
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(rows):
        plen, total = int(torch.randint(100, 301, (1,), generator=g)), int(torch.randint(3900, 4101, (1,), generator=g))
        prompts.append(torch.randint(5, vocab, (plen,), generator=g).tolist())
        responses.append(torch.randint(5, vocab, (total - plen,), generator=g).tolist())
    batch = pack_sequences(prompts, responses)
    mask = batch["response_mask"] = get_response_mask(batch)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["old_log_probs"] = (-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    batch["ref_log_probs"] = (-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    return batch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("fsdp_sp")
    folders = {name: make_tiny_model(root / name, "llama", layers=2, max_positions=8192, **kw)
               for name, kw in MODELS.items()}
    torch.save(long_batch(5), root / "batch.pt")
    args = dict(models={k: str(v) for k, v in folders.items()}, temperature=0.7,
                optim=dict(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.01),
                actor=dict(ppo_mini_batch_size=4, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1),
                budget=BUDGET)
    ranks = launch(WORLD, args, root)
    return {"root": root, "ranks": ranks, "folders": folders}


def _load(run, name):
    return torch.load(run["root"] / f"{name}.pt")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("sp", SPS[1:])
def test_sp_equals_one_rank_per_sequence(run, model, sp):
    from safetensors.torch import load_file

    one, got = _load(run, f"{model}.sp1.forward"), _load(run, f"{model}.sp{sp}.forward")
    for key in ("log_probs", "entropy"):
        assert got[key].shape == one[key].shape
        assert float((got[key] - one[key]).abs().max()) <= LOGP_TOL, key
    w1, w = _load(run, f"{model}.sp1.update"), _load(run, f"{model}.sp{sp}.update")
    start = load_file(str(run["folders"][model] / "model.safetensors"))
    assert max(float((w1[n] - start[n]).abs().max()) for n in w1) > 100 * WEIGHT_TOL, "the step must move"
    assert max_diff(w, w1) <= WEIGHT_TOL
    m1 = run["ranks"][0]["checks"][f"{model}.sp1"]
    checks = [r["checks"][f"{model}.sp{sp}"] for r in run["ranks"]]
    assert all(c["metrics"] == checks[0]["metrics"] for c in checks), "metrics must be identical on every rank"
    assert checks[0]["metrics"]["loss"] == pytest.approx(m1["metrics"]["loss"], rel=1e-4, abs=1e-6)
    assert checks[0]["metrics"]["grad_norm"] == pytest.approx(m1["metrics"]["grad_norm"], rel=1e-4)
    assert checks[0]["dp"] == WORLD // sp and checks[0]["attention"] == "verl_hpc_ulysses"
    assert m1["dp"] == WORLD and m1["attention"] == "sdpa"


def test_a_token_budget_is_per_rank_so_a_group_takes_sp_times_it(run):
    """4 rows over 2 groups of sp 2: with the budget per rank each group packs its two ~4k rows into
    one micro-batch (8,400 tokens between its 2 ranks) where one rank alone would take one row; the
    update is sp 1's all the same."""
    got, one = run["ranks"][0]["checks"]["llama.sp2.budget"], run["ranks"][0]["checks"]["llama.sp2"]
    assert got["metrics"]["num_microbatches"] == 1 and one["metrics"]["num_microbatches"] == 2
    assert max_diff(_load(run, "llama.sp2.budget.update"), _load(run, "llama.sp1.update")) <= WEIGHT_TOL


def test_sp_composes_with_hsdp(run):
    """sp 2 on a (replicate 2, shard 2) mesh: the sp groups are the shard groups; the update is sp 1's."""
    got = run["ranks"][0]["checks"]["llama.sp2.hsdp"]
    assert got["mesh"] == [2, 2] and got["dp"] == 2
    assert max_diff(_load(run, "llama.sp2.hsdp.update"), _load(run, "llama.sp1.update")) <= WEIGHT_TOL
