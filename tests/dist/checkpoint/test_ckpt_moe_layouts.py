"""A mixture-of-experts checkpoint is layout independent across expert parallelism as across
TP/PP: saved at EP2 (each rank holding 2 of 4 experts), loaded at EP1 (every rank all 4) and saved
again, loaded back at EP2 and saved again: the three checkpoints hold bitwise the same tensors
(model and Adam states, experts under their global index), and the logits after the load at EP2 are
bitwise those after the step (at EP1 to fp32 rounding: the combine order of a token's experts
differs). Qwen2-MoE, so the shared expert and its gate go through too."""
from pathlib import Path

import pytest
import torch

from jobs import read_all

pytestmark = pytest.mark.no_vllm("MoE checkpoints across layouts: no rollout")

HERE = Path(__file__).resolve().parent
IDS = torch.randint(5, 480, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from rank_launcher import launch_ranks

    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("ckpt_moe")
    model = make_tiny_model(root / "model", "qwen2_moe", seed=4)
    a, b, c = (str(root / n) for n in "abc")
    steps = [dict(name="ep2_trained", ep=2, train=True, save=a), dict(name="ep1", ep=1, load=a, save=b),
             dict(name="ep2_again", ep=2, load=b, save=c)]
    ranks = launch_ranks(HERE / "ckpt_moe_ranks.py", 2, {"model": str(model), "ids": IDS, "steps": steps},
                         root / "ranks", timeout=400, what="MoE checkpoint layouts")
    logits = {s["name"]: torch.load(root / "ranks" / f"{s['name']}.logits.pt", weights_only=True) for s in steps}
    return dict(a=a, b=b, c=c, logits=logits, ranks=ranks, model=model)


def test_ckpt_moe_ep2_to_ep1_to_ep2_bitwise(run):
    assert [r["ep2_trained.ep_rank"] for r in run["ranks"]] == [0, 1]
    assert [r["ep1.ep_rank"] for r in run["ranks"]] == [0, 0]
    ta, tb, tc = read_all(run["a"]), read_all(run["b"]), read_all(run["c"])
    experts = [n for n in ta if ".mlp.experts." in n]
    # 2 layers x 4 experts x (gate, up, down) under global indices, for the weights and Adam's states
    assert {n.split(".mlp.experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}
    assert any(n.startswith("actor/optim/") for n in experts)
    assert any("shared_experts" in n for n in ta) and any("router" in n for n in ta)
    assert sorted(ta) == sorted(tb) == sorted(tc)
    assert [n for n in ta if not (torch.equal(ta[n], tb[n]) and torch.equal(ta[n], tc[n]))] == []
    lg = run["logits"]
    assert torch.equal(lg["ep2_again"], lg["ep2_trained"])  # the same layout again: bit for bit
    # EP1 combines each token's expert outputs in another order (fp32 rounding only)
    diff = (lg["ep1"] - lg["ep2_trained"]).abs().max().item()
    print(f"max |logit EP1 - logit EP2| = {diff:.2e}")
    assert diff <= 1e-5


def test_ckpt_moe_hf_export_matches_the_engine(run, tmp_path):
    """`export --hf` of the EP2 checkpoint (one process, no Megatron) loads in transformers with the
    engine's logits: every expert, the router and the shared expert land under their HF names."""
    from transformers import AutoModelForCausalLM

    from verl_hpc.checkpoint.hf_export import export_hf

    folder = export_hf(run["a"], tmp_path / "hf", model=str(run["model"]))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor(IDS)).logits
    diff = (logits - run["logits"]["ep2_trained"]).abs().max().item()
    print(f"max |transformers(export) - engine| = {diff:.2e}")
    assert diff <= 1e-4


def test_moe_dispatcher_bytes_equal_the_formula(run):
    """The alltoall dispatcher's payload over the EP group (both ranks) against
    benchmarks/scaling_formulas.moe_alltoall_bytes: a forward of the logits' ids on each rank, and
    a train step (forward and backward) of the batch split over the 2 ranks."""
    import sys

    sys.path.insert(0, str(HERE.parents[2] / "benchmarks"))
    from scaling_formulas import moe_alltoall_bytes

    layers, hidden, top_k = 2, 128, 2  # the tiny qwen2_moe
    ranks = run["ranks"]
    forward = sum(r["ep2_trained.alltoall_forward"] for r in ranks)
    tokens = 2 * len(IDS) * len(IDS[0])  # every rank scores the same ids
    want = moe_alltoall_bytes(layers, hidden, top_k, tokens, 4, backward=False)
    train = sum(r["ep2_trained.alltoall_train"] for r in ranks)
    want_train = moe_alltoall_bytes(layers, hidden, top_k, sum(r["train_tokens_here"] for r in ranks), 4,
                                    backward=True)
    print(f"dispatcher all_to_all bytes: forward {forward} / formula {want}; train {train} / {want_train}")
    assert abs(forward / want - 1) <= 0.02 and abs(train / want_train - 1) <= 0.02
    assert [r["ep1.alltoall_forward"] for r in ranks] == [0, 0]  # EP1: no expert-parallel traffic


def test_ckpt_moe_step_reports_router_statistics(run):
    m = run["ranks"][0]["ep2_trained.metrics"]
    assert m["moe/dropped_fraction"] == 0.0  # dropless by default
    assert 1.0 <= m["moe/load_imbalance"] <= 4.0  # 1 = balanced, E = 4 = all tokens on one expert
    assert m["moe/aux_loss"] > 0
    assert m == run["ranks"][1]["ep2_trained.metrics"]  # every rank reports the same step
