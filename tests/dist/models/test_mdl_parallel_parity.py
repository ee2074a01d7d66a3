"""HF -> Megatron on 4 real gloo ranks: logits equal transformers' at TP1, TP2, PP2 and TP2xPP2,
export gives the checkpoint back bit for bit, TP ranks read only their slices, one
DDP + DistributedOptimizer step runs on CPU with the right gradient norm, and the sliced weight
sync (dense and delta) gives every inference-TP rank (TP 1, 2, 4) exactly its slices.

One launch of 4 ranks serves every layout in turn (data parallelism fills the ranks a layout
leaves: TP1 runs as DP4, TP2 and PP2 as DP2), because spawning and importing Megatron is the
expensive part. Several tiny models per layout, so every family and tying appears at several
layouts without running every combination:

    layout   models checked (forward parity)                             also
    tp1      llama (4 layers, 2-file checkpoint), qwen2-tied,             DDP+DistOpt step (DP4),
             llama-tied, qwen2, mistral, llama3 and linear RoPE scaling   sliced sync of qwen2
    tp2      llama (reads spied), qwen2-tied, qwen2                       slice-only reads,
                                                                          DDP+DistOpt step (DP2),
                                                                          sliced sync of both qwen2
    pp2      llama, llama-tied (embedding and lm_head on two stages)      export, sliced: llama-tied
    tp2xpp2  llama, qwen2-tied                                            export, sliced: both
    pp2vpp2  llama (2 virtual stages per rank, interleaved schedule)      export, sliced
"""
from pathlib import Path

import pytest
import torch

from mdl_ranks import launch

pytestmark = pytest.mark.no_vllm("model parity across layouts; the sliced sync into a sink, not vLLM")


TOL = 1e-4
WORLD = 4
MODELS = {  # name -> make_tiny_model kwargs
    "llama": dict(family="llama", layers=4, shards=2),
    "qwen2_tied": dict(family="qwen2", tied=True),
    "llama_tied": dict(family="llama", tied=True, seed=1),
    "qwen2": dict(family="qwen2", seed=2),
    "mistral": dict(family="mistral", seed=3),
    # RoPE scaling with thresholds inside 16 tokens, so it changes these logits
    "llama_rope3": dict(family="llama", seed=4, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "qwen2_linear": dict(family="qwen2", seed=5, rope_scaling=dict(rope_type="linear", factor=4.0)),
}
LAYOUTS = {  # name -> (tp, pp, models, models to export, spied model, train smoke, sliced sync)
    "tp1": (1, 1, ["llama", "qwen2_tied", "llama_tied", "qwen2", "mistral", "llama_rope3",
                   "qwen2_linear"], [], None, True, ["qwen2"]),
    "tp2": (2, 1, ["llama", "qwen2_tied", "qwen2"], [], "llama", True, ["qwen2", "qwen2_tied"]),
    "pp2": (1, 2, ["llama", "llama_tied"], ["llama_tied"], None, False, ["llama_tied"]),
    "tp2xpp2": (2, 2, ["llama", "qwen2_tied"], ["llama", "qwen2_tied"], None, False, ["llama", "qwen2_tied"]),
    # 2 virtual stages per rank: llama's 4 layers as chunks 0,2 | 1,3; interleaved schedule
    "pp2vpp2": (1, 2, ["llama"], ["llama"], None, False, ["llama"]),
}
VPP = {"pp2vpp2": 2}


def _make_models(root):
    """Tiny HF folders, each with ref_logits.pt: transformers' fp32 logits for a fixed batch and
    the gradient norm of the train smoke's loss (next-token cross-entropy, labels = ids rolled)."""
    from transformers import AutoModelForCausalLM

    from verl_hpc.models.tiny import make_tiny_model

    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(7))
    out = {}
    for name, kw in MODELS.items():
        folder = make_tiny_model(root / name, **kw)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        logits = hf(ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()).backward()
        grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in hf.parameters()))
        torch.save({"ids": ids, "logits": logits.detach(), "grad_norm": grad_norm},
                   folder / "ref_logits.pt")
        out[name] = str(folder)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Per layout: the list of the 4 ranks' results."""
    root = tmp_path_factory.mktemp("mdl_parity")
    dirs = _make_models(root / "models")
    layouts = []
    for name, (tp, pp, names, exports, spied, smoke, sliced) in LAYOUTS.items():
        specs = [dict(name=n, dir=dirs[n], export=n in exports, spy=n == spied, sliced=n in sliced)
                 for n in names]
        layouts.append(dict(name=name, tp=tp, pp=pp, vpp=VPP.get(name), models=specs,
                            train_smoke=dict(dir=dirs["llama"], save_to=str(root / f"{name}.pt"))
                            if smoke else None))
    ranks = launch(WORLD, "layouts", dict(layouts=layouts), root / "run", timeout=400)
    out = {name: [dict(r["layouts"][name], rank=r["rank"]) for r in ranks] for name in LAYOUTS}
    out["_paths"] = {"root": root, **dirs}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers(layout, results):
    tp, pp, names, *_ = LAYOUTS[layout]
    ranks = results[layout]
    last = [r for r in ranks if r["pp_rank"] == pp - 1]
    assert len(last) == WORLD // pp and {r["dp"] for r in ranks} == {WORLD // (tp * pp)}
    for name in names:
        diffs = [r["models"][name]["max_diff"] for r in last]
        print(f"{layout} {name}: max |megatron - transformers| = {max(diffs):.2e}")
        assert max(diffs) <= TOL, (layout, name, diffs)
        for r in last:
            m = r["models"][name]
            assert m["full_shape"] == [2, 16, 500]  # the padded vocabulary never reaches callers
            assert m["padded_all_neg_inf"], "padded logits must be -inf in vocab-parallel output"
        # vocab 500 pads to 512 at tp 1 and 2: the last TP rank of each replica holds 12 columns
        assert sum(r["models"][name]["padded_cols_here"] for r in last) == 12 * (WORLD // (tp * pp))


@pytest.mark.parametrize("layout", ["pp2", "tp2xpp2", "pp2vpp2"])
def test_export_returns_the_checkpoint_on_every_rank(layout, results):
    exports = LAYOUTS[layout][3]
    ranks = results[layout]
    for name in exports:
        first = ranks[0]["models"][name]["export_names"]
        assert first[0] == "model.embed_tokens.weight" and "model.norm.weight" in first
        assert len(first) == len(set(first))
        assert ("lm_head.weight" in first) != name.endswith("_tied")
        for r in ranks:  # every rank yields every tensor, in the same order, bit-exact
            assert r["models"][name]["export_names"] == first, r["rank"]
            assert r["models"][name]["export_exact"], (layout, name, r["rank"])
        # all_stages=False: each stage yields exactly its own part
        parts = [r["models"][name]["stage_export_names"] for r in ranks
                 if r["dp_rank"] == 0 and r["tp_rank"] == 0]
        assert sum(parts, []) == first and all(parts)


def test_tp2_ranks_read_only_their_slices(results):
    """No TP-split HF tensor is read whole on a TP=2 rank; the two TP ranks of a replica
    together read each split tensor exactly once, and each norm once per rank."""
    name = LAYOUTS["tp2"][4]
    split_markers = ("_proj.weight", "_proj.bias", "embed_tokens", "lm_head")
    replica = [r for r in results["tp2"] if r["dp_rank"] == 0]
    assert len(replica) == 2
    totals = {}
    for r in replica:
        reads = r["models"][name]["reads"]
        assert reads, "the spy saw no reads"
        for n, got, full in reads:
            if any(m in n for m in split_markers):
                assert torch.Size(got).numel() < torch.Size(full).numel(), (
                    f"rank {r['rank']} read all of {n} {full}")
            totals.setdefault(n, [0, torch.Size(full).numel()])[0] += torch.Size(got).numel()
    assert any(m in n for n in totals for m in split_markers)
    for n, (total, full) in totals.items():
        assert total == (2 * full if "norm" in n else full), (n, total, full)


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_ddp_distributed_optimizer_step_on_cpu(layout, results):
    from transformers import AutoModelForCausalLM

    for r in results[layout]:
        smoke = r["train_smoke"]
        assert smoke["ok"] and smoke["max_param_change"] > 0
        assert smoke["unmarked_split_weights"] == []
        assert smoke["grad_norm"] == pytest.approx(smoke["ref_norm"], rel=1e-5)
    # the updated weights, exported from the DDP-wrapped model, reproduce Megatron's logits in HF
    saved = torch.load(results["_paths"]["root"] / f"{layout}.pt")
    hf = AutoModelForCausalLM.from_pretrained(results["_paths"]["llama"], dtype=torch.float32)
    hf.load_state_dict(saved["state"], strict=True)
    with torch.no_grad():
        diff = (hf(saved["ids"]).logits - saved["logits"]).abs().max()
    print(f"{layout} after one step: max |transformers(exported) - megatron| = {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sliced_sync_gives_every_rollout_rank_its_slices_bitwise(layout, results):
    """Training TP1/TP2/PP2/TP2xPP2/PP2xVPP2 -> inference TP1/TP2/TP4 on 4 ranks: each rank's
    slices equal the checkpoint's (dense sync) and, after every 101st element moved, the new
    export's (delta sync); a rank receives exactly its shard (benchmarks/scaling_formulas.py), a
    delta about 1 % of the elements in index mode (8 bytes each), and at equal TP nothing crosses ranks."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from scaling_formulas import Model, rollout_shard_elements

    tp, pp, *_, sliced = LAYOUTS[layout]
    for name in sliced:
        m = Model.from_hf(results["_paths"][name])
        for r in results[layout]:
            runs = r["models"][name]["sliced"]
            for key, run in runs.items():
                itp = int(key[3])
                assert run["bad"] == [], (layout, name, r["rank"], key, run["bad"][:5])
                shard = 4 * rollout_shard_elements(m, itp, r["rank"] % itp)  # float32
                assert run["first"]["sync/bytes"] == shard, (layout, key)  # exact, not just within 2 %
                assert run["first"]["sync/dense_bytes"] == run["first"]["sync/bytes"]
                if itp == tp and pp == 1:
                    assert run["first"]["sync/wire_bytes"] == 0, (layout, key)
                if "second" in run:
                    frac = run["second"]["sync/changed_fraction"]
                    assert 0.008 < frac < 0.012, (layout, name, key, frac)
                    changed = frac * run["second"]["sync/dense_bytes"] / 4
                    assert run["second"]["sync/bytes"] == pytest.approx(8 * changed, rel=0.02)


def test_cpu_help_was_applied_on_every_rank(results):
    patches = {tuple(r["patches"]) for name in LAYOUTS for r in results[name]}
    assert len(patches) == 1
    assert any("random:_CUDA_RNG_STATE_TRACKER" in p for p in patches.pop())
