"""A GRPO job on a mixture-of-experts model at expert parallel 2 (two local ranks, the user's
command line): the whole RL step runs (HF rollout of the MoE model, the sliced weight sync taking
each rank's experts from the rank that holds them, the actor update with the router's load-
balancing loss, the rollout's routes replayed in the old-log-prob forward and the update:
model.moe_routing_replay=rollout), the router statistics and the router agreement are logged and
plotted, and the trainer's checkpoint holds every expert under its global index. (Learning on the demo task: `make demo-moe`, README.)"""
import pytest

from jobs import MOVING, grpo, logs, metrics, read_all


@pytest.fixture(scope="module")
def moe_run(tiny_assets, tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", seed=2)
    out = tmp_path_factory.mktemp("moe_run")
    proc, summary = grpo(tiny_assets, out, f"model.path={model}", "parallel.ep=2", "trainer.total_steps=2",
                         "slurm.cpus_per_task=1", "model.moe_aux_loss_coef=0.01", "tracking.plots=true",
                         "actor.micro_batch_size=4", "model.moe_routing_replay=rollout",
                         *MOVING, ranks=2)
    assert proc.returncode == 0, logs(proc, out)
    return out, summary


def test_trn_moe_grpo_step_at_ep2(moe_run):
    out, summary = moe_run
    assert summary["steps"] == 2
    rows = metrics(out)
    last = rows[-1]
    for key in ("actor/moe/load_imbalance", "actor/moe/aux_loss", "actor/moe/dropped_fraction",
                "actor/moe/layer_0/load_imbalance", "actor/moe/ep_rank_share/0", "actor/moe/ep_rank_share/1"):
        assert key in last, key
    assert last["actor/moe/dropped_fraction"] == 0.0
    assert abs(last["actor/moe/ep_rank_share/0"] + last["actor/moe/ep_rank_share/1"] - 1.0) < 1e-9
    # HF rollout keeps whole tensors: each rank receives the whole model, the experts of the other
    # EP rank over the sliced sync's all_to_all (bytes: benchmarks/bench_scaling.py layout 2x1e)
    assert last["sync/sliced"] == 1.0 and last["sync/sent_bytes"] > 0
    # routing replay at EP2: each rank replays the routes of its own rows, in both training forwards
    for key in ("moe/route_agreement", "moe/route_agreement/layer_1", "actor/moe/route_agreement"):
        assert 0.9 <= last[key] <= 1.0, (key, last.get(key))
    assert last["rollout/logprob_diff_max"] < 1e-5  # the rollout's routes in fp32: rounding only
    plots = list((out / "plots").glob("*.png"))
    assert plots, "the training curves (with the expert-load panel) are written"


def test_trn_moe_checkpoint_holds_every_expert(moe_run):
    out, _ = moe_run
    tensors = read_all(out / "checkpoints" / "step_000002")
    experts = {n.split(".mlp.experts.")[1].split(".")[0] for n in tensors if ".mlp.experts." in n}
    assert experts == {"0", "1", "2", "3"}
