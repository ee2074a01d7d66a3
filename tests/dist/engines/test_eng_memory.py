"""The memory plan against what the engine really holds, on 4 gloo ranks, 9 layouts in one launch.

For every layout and rank: the bytes behind the actor's parameters, main grads and optimizer
states and the reference's weights are within 5% of verl_hpc.planning's figures for that rank's
pipeline stage; the bytes autograd saves during a real training-mode forward of the rank's decoder
chunks are within 15% of the activation formula (Korthikanti et al. 2022, as the plan writes it)
for the layout's recompute setting. Sequence parallelism needs Transformer Engine (GPU) and is
covered by the formula tests (tests/unit/planning) only.
Offload (layout tp2pp2): exported weights after 3 RL-like steps are bitwise identical with offload
on and off, and the idle roles' resident bytes drop to the plan's idle figure (0).
"""
import pytest
import torch

from mem_ranks import launch
from verl_hpc.models import load_arch
from verl_hpc.planning.model_shape import stage_params
from verl_hpc.planning.phases import RoleState
from verl_hpc.planning.training import (ActivationSetup, Precision, model_state_bytes,
                                        stage_activation_bytes)

pytestmark = pytest.mark.no_vllm("the Megatron engine's memory: no rollout")


WORLD = 4
LAYOUTS = [
    dict(name="tp1", tp=1, pp=1),
    dict(name="tp1_selective", tp=1, pp=1, recompute="selective"),
    dict(name="tp1_full", tp=1, pp=1, recompute="full", method="uniform", num_layers=1),
    dict(name="tp2", tp=2, pp=1),
    dict(name="tp2_full_block", tp=2, pp=1, recompute="full", method="block", num_layers=1),
    dict(name="pp2", tp=1, pp=2),
    dict(name="pp2_selective", tp=1, pp=2, recompute="selective"),
    dict(name="pp2vpp2", tp=1, pp=2, vpp=2),
    dict(name="tp2pp2_full", tp=2, pp=2, recompute="full", method="uniform", num_layers=2,
         offload=True),
]
ACT_SEQ, ACT_BATCH = 64, 2
STATE_TOL, ACT_TOL = 0.05, 0.15


def _batch(n=8):
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 400, (int(p),), generator=g).tolist() for p in torch.randint(3, 9, (n,), generator=g)]
    resps = [torch.randint(5, 400, (int(r),), generator=g).tolist() for r in torch.randint(2, 10, (n,), generator=g)]
    b = pack_sequences(prompts, resps)
    b["response_mask"] = get_response_mask(b)  # as the trainer's batches carry it
    b["advantages"] = torch.randn(n, int(b["response_lengths"].max()), generator=g)
    return b


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("eng_memory")
    folder = make_tiny_model(root / "llama", layers=4)
    work = root / "work"
    work.mkdir()
    torch.save(_batch(), work / "batch.pt")
    args = dict(model=str(folder), optim=dict(lr=0.05, eps=1e-3), layouts=LAYOUTS,
                act_seq=ACT_SEQ, act_batch=ACT_BATCH)
    ranks = launch(WORLD, args, work)
    return {"ranks": ranks, "arch": load_arch(folder), "work": work}


def _planned(arch, layout, rank_out):
    tp, pp = layout["tp"], layout["pp"]
    params = stage_params(arch, tp, pp, rank_out["pp_rank"], "lm")
    prec = Precision.of("float32")
    actor = model_state_bytes(params, prec, trainable=True, dp=rank_out["dp"], distributed_optimizer=True)
    ref = model_state_bytes(params, prec, trainable=False, dp=rank_out["dp"], distributed_optimizer=True)
    setup = ActivationSetup(tp=tp, sequence_parallel=False, recompute=layout.get("recompute", "none"),
                            recompute_method=layout.get("method", "uniform"),
                            recompute_num_layers=layout.get("num_layers", 1), impl="local")
    last = rank_out["pp_rank"] == pp - 1
    acts = stage_activation_bytes(arch, params.layers, ACT_SEQ, ACT_BATCH, prec.act_bytes, setup, last)["saved"]
    return actor, ref, acts


def test_role_bytes_and_saved_activations_match_the_plan(run):
    arch, rows, bad = run["arch"], [], []
    header = (f"{'layout':<16}{'rank':>5}{'stage':>6}{'kind':>16}{'measured':>12}{'planned':>12}{'ratio':>8}")
    for layout in LAYOUTS:
        for r in run["ranks"]:
            out = r["layouts"][layout["name"]]
            actor, ref, acts = _planned(arch, layout, out)
            checks = [(f"actor.{k}", out["actor"][k], actor[k], STATE_TOL) for k in ("weights", "grads", "optimizer")]
            checks += [("ref.weights", out["ref"]["weights"], ref["weights"], STATE_TOL),
                       ("activations", out["activations"], acts, ACT_TOL)]
            for kind, measured, planned, tol in checks:
                ratio = measured / planned if planned else float("inf")
                rows.append(f"{layout['name']:<16}{r['rank']:>5}{out['pp_rank']:>6}{kind:>16}"
                            f"{measured:>12,}{int(planned):>12,}{ratio:>8.3f}")
                if abs(ratio - 1) > tol:
                    bad.append(rows[-1])
    print("\n" + header + "\n" + "\n".join(rows))
    assert not bad, "outside tolerance:\n" + header + "\n" + "\n".join(bad)


def test_offload_changes_nothing_and_frees_the_idle_roles(run):
    exports = torch.load(run["work"] / "tp2pp2_full.exports.pt")
    off, on = exports["off"], exports["on"]
    assert off.keys() == on.keys() and off
    for name in off:
        assert torch.equal(off[name], on[name]), name  # bitwise
    arch = run["arch"]
    for r in run["ranks"]:
        res = r["layouts"]["tp2pp2_full"]["offload"]
        for step in res["on"]["idle"]:
            # the plan's idle figure for a role offloading everything: RoleState.resident("idle")
            planned_idle = RoleState("actor", {"weights": 1.0, "grads": 1.0, "optimizer": 1.0},
                                     {"weights": True, "grads": True, "optimizer": True}).resident("idle")
            assert sum(step["actor"].values()) == planned_idle == 0, step
            assert step["ref"]["params"] == 0, step
        for step in res["off"]["idle"]:
            assert step["actor"]["params"] > 0 and step["ref"]["params"] > 0
        # resident again for an update: the same bytes as without offload
        assert res["on"]["walk_resident"] == res["off"]["walk_resident"]
        assert res["on"]["walk_idle"]["weights"] == 0
    assert arch.num_layers == 4
