"""The Megatron engine on a vision-language model (a tiny Qwen2.5-VL: Megatron's GPTModel with M-RoPE,
transformers' vision tower on the first pipeline stage, replicated over TP; models/vlm.py) on 4 gloo
ranks (vlm_ranks.py), against references computed here:

- log-probs at TP1 (DP4), TP2, PP2 and TP2 x PP2 equal a float64 transformers forward of each row;
- one update (tower frozen, and tower trained) at every layout equals the same update of a one-rank
  engine in this process: the language model, and the tower where it trains (its TP replicas stay
  bitwise equal: Megatron averages their gradients over TP); the frozen tower stays bitwise;
- a checkpoint carried Megatron TP2 -> FSDP (4 ranks) -> Megatron TP2 x PP2 is bitwise equal at
  each hop (weights and Adam moments in fp32, the tower's weights included), and each resumed
  engine's next update equals the saving engine's own within the engines' parity bound; and
  `checkpoint export --hf` of it is a folder transformers loads, holding those weights exactly.
The batch's rows run one per micro-batch, with a text-only row, so some ranks' micro-batches hold no
image (a trained tower then gets a zero gradient there: models/vlm.py says why it must get one).
"""
import gc

import pytest
import torch

from engine_states import one_rank_world
from jobs import read_all
from vlm_ranks import LAYOUTS, launch

pytestmark = pytest.mark.no_vllm("parity of the training engine's layouts and checkpoints: no rollout")

LOGP_TOL = 2e-5  # fp32 Megatron vs float64 transformers (test_eng_parity.py)
WEIGHT_TOL = 1e-5
OPTIM = dict(lr=0.5, eps=1.0, clip_grad=1.0, weight_decay=0.0)
ACTOR = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, loss_agg_mode="token-mean",
             ppo_mini_batch_size=8)


def _one_rank_reference(folder, batch, root) -> dict:
    """The same updates as every layout's, by a one-rank engine in this process."""
    from verl_hpc.parallel import cpu_compat, destroy_model_parallel, init_model_parallel
    from vlm_ranks import _engine, _update

    args = {"model": str(folder), "optim": OPTIM, "actor": ACTOR}
    out = {}
    with one_rank_world(root / "world"):
        init_model_parallel(1, 1, seed=1)
        try:
            for tower, changes in (("frozen", {}), ("trained", {"train_vision_tower": True})):
                eng = _engine(args, **changes)
                _update(eng, args, batch)
                out[tower] = {n: t.clone() for n, t in eng.export_hf_weights()}
                del eng
                gc.collect()
        finally:
            destroy_model_parallel()
            cpu_compat.revert()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from verl_hpc.models.tiny_vlm import make_tiny_vlm
    from vlm_reference import hf_logprobs64, image_batch

    root = tmp_path_factory.mktemp("eng_vlm")
    folder = make_tiny_vlm(root / "vlm", "qwen2_5_vl")
    batch, vp = image_batch(folder, seed=3, sizes=((70, 100), None, (56, 56), (84, 60, 60, 84), (56, 84)))
    refs = {"logp": hf_logprobs64(folder, batch, vp.image_token_id), "updated": _one_rank_reference(folder, batch, root)}
    work = root / "work"
    work.mkdir()
    torch.save(batch, work / "batch.pt")
    ranks = launch(4, {"model": str(folder), "optim": OPTIM, "actor": ACTOR}, work)
    print("rank 0's phases (s):", {k: round(v, 1) for k, v in ranks[0]["seconds"].items()})
    return {"ranks": ranks, "refs": refs, "work": work, "batch": batch, "folder": folder}


def _load(run, name):
    return torch.load(run["work"] / f"{name}.pt", weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_equal_float64_transformers(run, layout):
    got = _load(run, f"{layout}.forward")["log_probs"].double()
    want, mask = run["refs"]["logp"], run["batch"]["response_mask"]
    diff = float(((got - want[:, :got.shape[1]]).abs() * mask).max())
    print(f"{layout}: log-probs vs float64 transformers {diff:.2e}")
    assert diff <= LOGP_TOL, diff
    assert bool((got[mask == 0] == 0).all())


@pytest.mark.parametrize("tower", ["frozen", "trained"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_update_equals_one_rank(run, layout, tower):
    got, ref = _load(run, f"{layout}.{tower}"), run["refs"]["updated"][tower]
    from safetensors.torch import load_file

    start = load_file(str(run["folder"] / "model.safetensors"))
    moved = {n: float((ref[n] - start[n]).abs().max()) for n in ref}
    assert max(moved.values()) > 100 * WEIGHT_TOL, "the update must move the weights visibly"
    tower_moved = max(v for n, v in moved.items() if n.startswith("model.visual."))
    if tower == "frozen":
        assert tower_moved == 0.0
        assert all(torch.equal(got[n], start[n]) for n in got if n.startswith("model.visual."))
    else:
        assert tower_moved > 100 * WEIGHT_TOL, "a trained tower moves"
    diff = _max_diff(got, ref)
    print(f"{layout}, tower {tower}: weights after one update vs one rank {diff:.2e} (moved {max(moved.values()):.2e})")
    assert diff <= WEIGHT_TOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trained_tower_replicas_stay_equal_over_tp(run, layout):
    digests = {r["layouts"][layout]["checks"]["tower_digest"] for r in run["ranks"]} - {""}
    assert len(digests) == 1, digests  # every first-stage rank (TP and DP replicas) holds the same tower
    m = run["ranks"][0]["layouts"][layout]["checks"]["trained"]
    assert m["actor/nonfinite_steps"] == 0.0


def _bitwise(a_dir, b_dir) -> list:
    a, b = read_all(a_dir), read_all(b_dir)
    assert any(n.startswith("actor/model/visual.") for n in a), "the tower's weights are in the checkpoint"
    assert any(n.startswith("actor/optim/exp_avg_sq/decoder.") for n in a)
    only = sorted(set(a) ^ set(b))
    return only + [n for n in sorted(set(a) & set(b)) if a[n].dtype != torch.float32 or not torch.equal(a[n], b[n])]


def test_checkpoint_megatron_tp2_to_fsdp_to_megatron_tp2pp2_is_bitwise(run):
    ck, meta = run["work"] / "ckpt", run["ranks"][0]["meta"]
    assert _bitwise(ck / "M1", ck / "F0") == [], "Megatron TP2 -> FSDP"
    assert _bitwise(ck / "F1", ck / "M2") == [], "FSDP -> Megatron TP2 x PP2"
    assert (meta["F0"]["format"], meta["F0"]["coords"], meta["M1"]["format"]) == (
        "verl_hpc.fsdp_engine/1", "megatron", "verl_hpc.megatron_engine/1")
    assert [meta[k]["optimizer_step"] for k in ("M1", "F0", "F1", "M2")] == [1, 1, 2, 2]


def test_resumed_engines_continue_as_the_saving_engine_would(run):
    w = {k: _load(run, f"chain.{k}") for k in ("megatron_tp2.step2", "fsdp.step2", "fsdp.step3",
                                               "megatron_tp2pp2.step3")}
    d2 = _max_diff(w["fsdp.step2"], w["megatron_tp2.step2"])
    d3 = _max_diff(w["megatron_tp2pp2.step3"], w["fsdp.step3"])
    moved = _max_diff(w["fsdp.step3"], w["fsdp.step2"])
    print(f"update 2 FSDP-after-M1 vs Megatron TP2: {d2:.2e}; update 3 Megatron TP2xPP2-after-F1 vs FSDP: "
          f"{d3:.2e}; an update moves weights by {moved:.2e}")
    assert d2 <= WEIGHT_TOL and d3 <= WEIGHT_TOL
    assert moved > 100 * WEIGHT_TOL
    lr = run["ranks"][0]["lr"]
    assert lr["fsdp.2"] == pytest.approx(0.46) and lr["megatron_tp2pp2.3"] == pytest.approx(0.42)


def test_checkpoint_exports_a_folder_transformers_loads(run, tmp_path):
    """`checkpoint export --hf` of M2 (Megatron TP2 x PP2's save of what FSDP's update 2 left): a
    folder transformers loads whole, holding those weights exactly."""
    from transformers import AutoModelForImageTextToText

    from verl_hpc.checkpoint.hf_export import export_hf

    export_hf(run["work"] / "ckpt" / "M2", tmp_path / "hf")
    state = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    want = _load(run, "chain.fsdp.step2")
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[n], want[n]) for n in want)
