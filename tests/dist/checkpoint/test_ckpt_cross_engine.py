"""A checkpoint carried across engines and layouts: Megatron TP2 -> FSDP on 2 ranks -> Megatron
PP2, and an FSDP checkpoint between 1 and 2 ranks (issue 50, item 3).

One launch of 2 gloo ranks runs the three phases in turn (ckpt_engines_ranks.py); the one-rank
FSDP engine runs in this process, before the launch (it writes S1, which the ranks load) and after
it (it loads F1, written by 2 ranks):

    M1   Megatron TP2 after update 1            F0   FSDP (2 ranks) right after loading M1
    F1   FSDP after update 2                    M2   Megatron PP2 right after loading F1
    S1   FSDP (1 rank) after an update          S1r  FSDP (2 ranks) right after loading S1
    S2   FSDP (1 rank) right after loading F1

What is compared, every tensor of the two checkpoints (weights, both Adam moments), bitwise in
fp32: M1 = F0, F1 = M2, S1 = S1r, F1 = S2; and the meta's Adam step count and LR schedule. A
byte-exact round trip would also pass for a consistent misreading, so the resumed runs must go
on as the saving engine would have: the FSDP update 2 after loading M1 equals Megatron's own
update 2, and Megatron PP2's update 3 after loading F1 equals FSDP's own, within the engines'
parity bound (1e-5; different summation order, not different states). Every part maps exactly:
both engines keep fp32 weights and fp32 moments on CPU, under the same logical names.
"""
import gc
from pathlib import Path

import pytest
import torch

from engine_states import engine, load, make_batch, one_rank_world, save, update
from jobs import read_all

pytestmark = pytest.mark.no_vllm("checkpoints between the training engines: no rollout")

HERE = Path(__file__).resolve().parent
WEIGHT_TOL = 1e-5  # the engines' update parity (tests/dist/engines/test_eng_parity.py)
BATCH_SEEDS = [101, 102, 103]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from rank_launcher import launch_ranks
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("cross_engine")
    model = str(make_tiny_model(root / "model", "qwen2", layers=2, seed=4))
    ck = {k: root / k for k in ("M1", "F0", "F1", "M2", "S1", "S1r", "S2")}
    with one_rank_world(root / "w1"):
        eng = engine("fsdp", model)
        update(eng, make_batch(7))
        s1_meta = save(eng, ck["S1"], 1, {"fsdp": 1})
        del eng
        gc.collect()
    ranks = launch_ranks(HERE / "ckpt_engines_ranks.py", 2,
                         {"model": model, "batch_seeds": BATCH_SEEDS, "ckpt": {k: str(v) for k, v in ck.items()}},
                         root / "ranks", timeout=300, what="cross-engine checkpoint chain")
    with one_rank_world(root / "w2"):
        eng = engine("fsdp", model)
        load(eng, ck["F1"] / "step_000002")
        s2_meta = save(eng, ck["S2"], 2, {"fsdp": 1})
        del eng
        gc.collect()
    print(f"rank 0's phases (s): {ranks[0]['seconds']}")
    meta = dict(ranks[0]["meta"], S1=s1_meta, S2=s2_meta)
    weights = {p.stem: torch.load(p, weights_only=True) for p in (root / "ranks").glob("*.step*.pt")}
    return dict(ck=ck, meta=meta, lr=ranks[0]["lr"], weights=weights)


def _bitwise(a_dir: Path, b_dir: Path) -> list:
    """The tensors that differ between two checkpoints (names held by one only count too)."""
    a, b = read_all(a_dir), read_all(b_dir)
    assert any(n.startswith("actor/optim/exp_avg_sq/") for n in a)
    assert any(n.endswith("linear_qkv.bias") for n in a)  # qwen2: the q/k/v biases map too
    only = sorted(set(a) ^ set(b))
    return only + [n for n in sorted(set(a) & set(b)) if a[n].dtype != torch.float32 or not torch.equal(a[n], b[n])]


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_megatron_tp2_to_fsdp_to_megatron_pp2_is_bitwise(chain):
    ck, meta = chain["ck"], chain["meta"]
    assert _bitwise(ck["M1"], ck["F0"]) == [], "Megatron TP2 -> FSDP: weights and Adam moments in fp32"
    assert _bitwise(ck["F1"], ck["M2"]) == [], "FSDP -> Megatron PP2: weights and Adam moments in fp32"
    assert (meta["M1"]["format"], meta["F0"]["format"], meta["F0"]["coords"]) == (
        "verl_hpc.megatron_engine/1", "verl_hpc.fsdp_engine/1", "megatron")
    # Adam's step count and the LR schedule carry over both ways
    assert [meta[k]["optimizer_step"] for k in ("M1", "F0", "F1", "M2")] == [1, 1, 2, 2]
    assert meta["F0"]["scheduler"] == meta["M1"]["scheduler"]
    assert meta["M2"]["scheduler"] == meta["F1"]["scheduler"] and meta["M2"]["scheduler"]["num_steps"] == 2


def test_resumed_engines_continue_the_run_as_the_saving_engine_would(chain):
    w, lr = chain["weights"], chain["lr"]
    d2 = _max_diff(w["fsdp.step2"], w["megatron_tp2.step2"])
    d3 = _max_diff(w["megatron_pp2.step3"], w["fsdp.step3"])
    moved = _max_diff(w["fsdp.step3"], w["fsdp.step2"])
    print(f"update 2 FSDP-after-M1 vs Megatron TP2: {d2:.2e}; update 3 Megatron PP2-after-F1 vs FSDP: {d3:.2e}; "
          f"an update moves weights by {moved:.2e}")
    assert d2 <= WEIGHT_TOL and d3 <= WEIGHT_TOL
    assert moved > 100 * WEIGHT_TOL  # an update moves the weights far beyond the bound
    # linear decay 0.5 -> 0.1 over 10 steps: the LR each update used, in either engine
    assert lr["fsdp.loaded"] == lr["fsdp.2"] == pytest.approx(lr["megatron_tp2.2"]) == pytest.approx(0.46)
    assert lr["megatron_pp2.loaded"] == lr["megatron_pp2.3"] == pytest.approx(lr["fsdp.3"]) == pytest.approx(0.42)


def test_fsdp_checkpoint_loads_at_another_world_size(chain):
    ck, meta = chain["ck"], chain["meta"]
    assert _bitwise(ck["S1"], ck["S1r"]) == [], "written by 1 rank, loaded by 2"
    assert _bitwise(ck["F1"], ck["S2"]) == [], "written by 2 ranks, loaded by 1"
    assert meta["S1r"]["optimizer_step"] == 1 and meta["S2"]["optimizer_step"] == 2
