"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE with its
q/k norms, DeepSeek-V3 with latent attention, the biased sigmoid router, grouped top-k, a shared
expert and a dense first layer) from HF into Megatron-Core MoE on 4 real gloo ranks: logits equal transformers' at EP1,
EP2, TP2 and EP2xPP2 (and TP2xEP2), the export gives the checkpoint back bit for bit on every rank
with each EP rank reading only its own experts, and the sliced weight sync gives every inference
rank exactly its slices of the experts it needs from whichever EP rank holds them.

One launch of 4 ranks serves every layout (data parallelism fills the rest; expert parallelism
regroups the data-parallel ranks of a stage, as Megatron does):

    layout    tp pp ep   models (forward parity, export, sliced sync)
    ep1       1  1  1    all four (DP 4, experts replicated)
    ep2       1  1  2    all four (DP 4: two expert-parallel groups of 2)
    tp2       2  1  1    all four (expert TP = TP = 2)
    ep2xpp2   1  2  2    all four (each stage's 2 DP ranks are its 2 EP ranks)
    tp2xep2   2  1  2    qwen2_moe, deepseek_v3 (the 4 ranks of the stage: expert TP 2 x EP 2)
"""
from pathlib import Path

import pytest
import torch

from mdl_ranks import launch

pytestmark = pytest.mark.no_vllm("MoE model parity across layouts: no rollout")

TOL = 1e-4  # the dense parity tolerance (test_mdl_parallel_parity.py)
WORLD = 4
MODELS = {"mixtral": dict(family="mixtral", seed=11), "qwen2_moe": dict(family="qwen2_moe", seed=12),
          "qwen3_moe": dict(family="qwen3_moe", seed=13), "deepseek_v3": dict(family="deepseek_v3", seed=14)}
ALL = list(MODELS)
DENSE_FIRST = {"deepseek_v3": 1}  # the tiny DeepSeek-V3's layer 0 is dense (first_k_dense_replace)
LAYERS = 2  # every tiny model's
LAYOUTS = {  # name -> (tp, pp, ep, models)
    "ep1": (1, 1, 1, ALL), "ep2": (1, 1, 2, ALL), "tp2": (2, 1, 1, ALL),
    "ep2xpp2": (1, 2, 2, ALL), "tp2xep2": (2, 1, 2, ["qwen2_moe", "deepseek_v3"]),
}


def _make_models(root):
    from transformers import AutoModelForCausalLM

    from verl_hpc.models.tiny import make_tiny_model

    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(7))
    out = {}
    for name, kw in MODELS.items():
        folder = make_tiny_model(root / name, **kw)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        torch.save({"ids": ids, "logits": hf(ids).logits.detach()}, folder / "ref_logits.pt")
        out[name] = str(folder)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("mdl_moe")
    dirs = _make_models(root / "models")
    layouts = [dict(name=name, tp=tp, pp=pp, ep=ep,
                    models=[dict(name=n, dir=dirs[n], export=True, spy=True, sliced=True) for n in names])
               for name, (tp, pp, ep, names) in LAYOUTS.items()]
    ranks = launch(WORLD, "layouts", dict(layouts=layouts), root / "run", timeout=600)
    out = {name: [dict(r["layouts"][name], rank=r["rank"]) for r in ranks] for name in LAYOUTS}
    out["_paths"] = {"root": root, **dirs}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_logits_match_transformers(layout, results):
    tp, pp, ep, names = LAYOUTS[layout]
    ranks = results[layout]
    assert {r["ep"] for r in ranks} == {ep}
    assert sorted({r["ep_rank"] for r in ranks}) == list(range(ep))
    last = [r for r in ranks if r["pp_rank"] == pp - 1]
    for name in names:
        diffs = [r["models"][name]["max_diff"] for r in last]
        print(f"{layout} {name}: max |megatron - transformers| = {max(diffs):.2e}")
        assert max(diffs) <= TOL, (layout, name, diffs)
        assert all(r["models"][name]["full_shape"] == [2, 16, 500] for r in last)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_export_returns_the_checkpoint_on_every_rank(layout, results):
    names = LAYOUTS[layout][3]
    ranks = results[layout]
    for name in names:
        first = ranks[0]["models"][name]["export_names"]
        assert len(first) == len(set(first))
        for r in ranks:  # every rank yields every tensor (all experts), in the same order, bit-exact
            assert r["models"][name]["export_names"] == first, r["rank"]
            assert r["models"][name]["export_exact"], (layout, name, r["rank"])


@pytest.mark.parametrize("layout", ["ep2", "ep2xpp2", "tp2xep2"])
def test_moe_ep_ranks_read_only_their_experts(layout, results):
    """An expert's matrices are read by the ranks of its EP rank only; the router and the shared
    expert by every rank (replicated over EP); a stage of dense layers only reads no expert."""
    tp, pp, ep, names = LAYOUTS[layout]
    per_rank = 4 // ep
    for r in results[layout]:
        for name in names:
            experts = set()
            for hf_name, *_ in r["models"][name]["reads"]:
                if ".experts." in hf_name:
                    experts.add(int(hf_name.split(".experts.")[1].split(".")[0]))
            stage = range(r["pp_rank"] * LAYERS // pp, (r["pp_rank"] + 1) * LAYERS // pp)
            has_moe = any(i >= DENSE_FIRST.get(name, 0) for i in stage)
            mine = set(range(r["ep_rank"] * per_rank, (r["ep_rank"] + 1) * per_rank)) if has_moe else set()
            assert experts == mine, (layout, name, r["rank"], experts, mine)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_sliced_sync_gives_every_inference_rank_its_slices(layout, results):
    for name in LAYOUTS[layout][3]:
        for r in results[layout]:
            rows = r["models"][name]["sliced"]
            assert set(rows) == {"itp1", "itp1_delta", "itp2", "itp2_delta", "itp4", "itp4_delta"}
            for key, row in rows.items():
                assert row["bad"] == [], (layout, name, r["rank"], key, row["bad"][:3])
                assert row["first"]["sync/bytes"] > 0
