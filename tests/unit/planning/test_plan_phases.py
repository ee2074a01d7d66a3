"""The memory plan's rows follow what the trainer runs (issue 27): a checkpoint and a rollback's
reload with vLLM asleep and each role's weights + optimizer resident (no gradients), the weight
sync in the first of two wake stages (vLLM's weights, not its KV cache), CUDA graphs on the host
while vLLM sleeps, NCCL's communicators counted per process group, pinned host buffers rounded to
powers of two."""
from pathlib import Path

import pytest

from verl_hpc.config import load_config
from verl_hpc.planning import hardware, plan_job
from verl_hpc.planning.phases import PHASES

REPO = Path(__file__).resolve().parents[3]
GRPO = str(REPO / "configs/grpo_8b.yaml")
ROLLBACK = ["trainer.rollback.enable=true", "checkpoint.save_every=2", "checkpoint.keep_last=3"]


def actor_parts(plan_cfg):
    """The actor's weights / grads / optimizer bytes as the plan sizes them (stage 0)."""
    from verl_hpc.planning.model_shape import KNOWN, stage_params
    from verl_hpc.planning.training import Precision, model_state_bytes

    p = plan_cfg.parallel
    return model_state_bytes(stage_params(KNOWN["llama-3-8b"], p.tp, p.pp, 0), Precision.of("bfloat16"),
                             trainable=True, dp=plan_cfg.dp, distributed_optimizer=p.use_distributed_optimizer)


def test_phases_follow_the_agreed_step_order():
    assert PHASES == ("build", "startup", "weight_sync", "rollout", "reward_score", "old_logprob", "ref_logprob",
                      "teacher_logprob", "prm_logprob", "update_prm", "values", "update_critic", "update_actor",
                      "checkpoint", "rollback")
    teacher = ["teacher.enable=true", "teacher.mode=loss", "teacher.model_path=/path/to/Meta-Llama-3-70B-Instruct"]
    rm = ["reward.reward_model.enable=true", "reward.reward_model.path=/path/to/Meta-Llama-3-8B-rm"]
    plan = plan_job(load_config(str(REPO / "configs/ppo_70b.yaml"), [*ROLLBACK, "prm.enable=true", *teacher, *rm]))
    assert list(plan.table) == list(PHASES)  # printed in run order


@pytest.mark.parametrize("offload", [True, False])
def test_checkpoint_holds_weights_and_optimizer_not_grads_with_vllm_asleep(offload):
    flags = [] if offload else [f"actor.{f}=false" for f in ("param_offload", "grad_offload", "optimizer_offload")]
    cfg = load_config(GRPO, flags)
    plan = plan_job(cfg, stage=0)
    parts = actor_parts(cfg)
    row = plan.table["checkpoint"]
    if offload:  # made resident for the save: weights + optimizer, the gradients stay dropped
        assert row["actor"] == pytest.approx(parts["weights"] + parts["optimizer"])
    else:  # nothing offloaded: the gradient buffers are resident anyway
        assert row["actor"] == pytest.approx(sum(parts.values()))
    assert row["vllm"] == 0.0  # asleep: no KV cache, no weights, graphs on the host
    # the old row counted the awake-vLLM case the issue describes only as the rollout row
    assert plan.phase_total("checkpoint") < plan.phase_total("update_actor")


def test_rollback_row_only_when_rollback_is_enabled():
    assert "rollback" not in plan_job(load_config(GRPO, [])).table
    cfg = load_config(GRPO, ROLLBACK)
    plan = plan_job(cfg, stage=0)
    parts = actor_parts(cfg)
    row = plan.table["rollback"]
    assert row["actor"] == pytest.approx(parts["weights"] + parts["optimizer"])
    assert row["vllm"] == 0.0
    # the reader's buffers are on the host: the rollback phase's host figure is above the idle one
    assert plan.host["rollback"] > plan.host["update_actor"]


def test_weight_sync_maps_vllm_weights_but_not_its_kv_cache():
    from verl_hpc.planning.model_shape import KNOWN, total_params

    cfg = load_config(GRPO, [])
    plan = plan_job(cfg, stage=0)
    weights = total_params(KNOWN["llama-3-8b"]) * 2 / cfg.rollout.tp
    assert plan.table["weight_sync"]["vllm"] == pytest.approx(weights)
    assert plan.table["rollout"]["vllm"] == pytest.approx(cfg.rollout.gpu_memory_utilization * plan.limit)
    assert plan.table["weight_sync"]["resharding"] > 0
    # the actor's weights (not its optimizer) stay resident for the whole sync
    assert plan.table["weight_sync"]["actor"] == pytest.approx(actor_parts(cfg)["weights"])


@pytest.mark.parametrize("level", [1, 2])
def test_cuda_graphs_go_to_the_host_while_vllm_sleeps(level):
    eager = plan_job(load_config(GRPO, [f"rollout.sleep_level={level}", "rollout.enforce_eager=true"]))
    graphs = plan_job(load_config(GRPO, [f"rollout.sleep_level={level}", "rollout.enforce_eager=false"]))
    for phase in ("old_logprob", "update_actor", "checkpoint"):
        assert graphs.table[phase]["vllm"] == 0.0
    per_node = graphs.ranks_per_node
    assert graphs.host["update_actor"] - eager.host["update_actor"] == pytest.approx(
        per_node * hardware.VLLM_GRAPH_BYTES)


def test_auto_means_sleep_and_cuda_graphs_on_a_gpu_job():
    """rollout.sleep_between_phases / enforce_eager "auto" (the GPU defaults): sleep on, graphs on."""
    cfg = load_config(GRPO, [])
    cfg.rollout.sleep_between_phases, cfg.rollout.enforce_eager = "auto", "auto"
    explicit = plan_job(load_config(GRPO, ["rollout.sleep_between_phases=true", "rollout.enforce_eager=false"]))
    auto = plan_job(cfg)
    assert auto.table == explicit.table and auto.host == explicit.host


def test_nccl_figure_counts_the_groups_each_rank_belongs_to():
    from verl_hpc.planning.comms import job_communicators

    def plan_and_comms(*overrides):
        cfg = load_config(GRPO, list(overrides))
        return plan_job(cfg), job_communicators(cfg, tied_embeddings=False)

    base, comms = plan_and_comms()
    used = sum(1 for c in comms if c.size > 1 and c.in_use)
    idle = sum(1 for c in comms if c.size > 1 and not c.in_use)
    assert base.table["update_actor"]["nccl"] == pytest.approx(
        used * hardware.NCCL_COMM_BYTES + idle * hardware.NCCL_IDLE_COMM_BYTES)
    # TP 1 (8 DP ranks, vLLM TP 1): TP-sized groups have one rank and cost nothing
    tp1, comms1 = plan_and_comms("parallel.tp=1", "rollout.tp=1", "parallel.sequence_parallel=false")
    assert sum(c.size > 1 for c in comms1) < sum(c.size > 1 for c in comms)
    assert tp1.table["update_actor"]["nccl"] < base.table["update_actor"]["nccl"]
    # every phase carries them (NCCL buffers are not released by sleep or offload)
    assert len({round(r["nccl"]) for r in base.table.values()}) == 1
    # a CPU job holds no NCCL communicator
    cpu = plan_job(load_config(GRPO, ["slurm.gpus_per_node=0", "parallel.backend=gloo", "slurm.mem_gb=512"]))
    assert all(r["nccl"] == 0 for r in cpu.table.values())


@pytest.mark.parametrize("world,tp,pp,cp", [(8, 2, 1, 1), (64, 8, 2, 1), (16, 2, 4, 1), (4, 1, 1, 1),
                                           (16, 2, 1, 2), (32, 2, 2, 4), (8, 1, 1, 8)])
def test_megatron_group_list_matches_megatron_core(world, tp, pp, cp):
    """planning.comms mirrors megatron-core 0.16.1's initialize_model_parallel: run it with a
    recording new_group and compare the NCCL groups of a first- and a last-stage rank."""
    from unittest import mock

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from verl_hpc.planning.comms import megatron_groups

    assert not ps.model_parallel_is_initialized()
    # groups of >= 2 ranks: a 1-rank group costs nothing (and the last stage is in no position-
    # embedding group at all)
    planned = [c.size for c in megatron_groups(world, tp, pp, distributed_optimizer=True, tied_embeddings=False, cp=cp)
               if c.size > 1]
    for rank in (0, world - 1):  # first stage, last stage
        made = []

        def new_group(ranks=None, backend=None, **kw):
            made.append((tuple(ranks), backend))
            return object()

        with mock.patch.object(dist, "is_initialized", lambda: True), \
                mock.patch.object(dist, "get_world_size", lambda *a, **k: world), \
                mock.patch.object(dist, "get_rank", lambda *a, **k: rank), \
                mock.patch.object(dist, "new_group", new_group):
            try:
                ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp)
            finally:
                ps.destroy_model_parallel()
        mine = [len(r) for r, backend in made if rank in r and backend != "gloo" and len(r) > 1]
        assert mine == planned, (rank, mine, planned)


def test_pinned_host_buffers_round_up_to_a_power_of_two():
    from verl_hpc.planning.host import RoleTensors

    assert hardware.pinned(0) == 0
    assert hardware.pinned(1) == 1
    assert hardware.pinned(3 << 20) == 4 << 20
    assert hardware.pinned(4 << 20) == 4 << 20
    assert hardware.pinned((4 << 20) + 1) == 8 << 20
    # an offloaded role: one buffer per DDP chunk for the weights, per tensor for Adam's states
    r = RoleTensors("actor", [3 << 20, 5 << 20], 2, True, 1, 1, 3,
                    {"weights": True, "grads": True, "optimizer": True})
    assert r.offloaded_pinned() == hardware.pinned(16 << 20) + 3 * (hardware.pinned(12 << 20)
                                                                    + hardware.pinned(20 << 20))
    # the plan's host figure of an offloading actor follows the rounded sizes, above the exact bytes
    from verl_hpc.planning.model_shape import KNOWN, stage_tensor_sizes

    common = ["checkpoint.async_save=false", "ref.param_offload=false"]
    off = [f"actor.{f}=false" for f in ("param_offload", "grad_offload", "optimizer_offload")]
    cfg = load_config(GRPO, common)
    with_offload, without = plan_job(cfg, stage=0), plan_job(load_config(GRPO, common + off), stage=0)
    per_rank = (with_offload.host["update_actor"] - without.host["update_actor"]) / with_offload.ranks_per_node
    sizes = stage_tensor_sizes(KNOWN["llama-3-8b"], cfg.parallel.tp, 1, 0)
    dp = cfg.dp
    assert per_rank == pytest.approx(hardware.pinned(sum(sizes) * 2)
                                     + 3 * sum(hardware.pinned(n * 4 / dp) for n in sizes))
    exact = sum(sizes) * (2 + 12 / dp)
    assert per_rank > exact * 1.05  # the rounding is not negligible: 8.0 GB of weights pin 8.6 GB


def test_sliced_sync_holds_one_bucket_more_and_delta_keeps_two_shards_everywhere():
    from verl_hpc.planning.model_shape import KNOWN, total_params

    full = plan_job(load_config(GRPO, ["resharding.mode=full"]), stage=0)
    sliced = plan_job(load_config(GRPO, []), stage=0)
    delta = plan_job(load_config(GRPO, ["resharding.delta=true"]), stage=0)
    bucket = load_config(GRPO, []).resharding.bucket_mb * 2 ** 20
    assert sliced.table["weight_sync"]["resharding"] - full.table["weight_sync"]["resharding"] == bucket
    cfg = load_config(GRPO, [])
    copies = 2 * total_params(KNOWN["llama-3-8b"]) * 2 / cfg.rollout.tp  # bf16 rollout, TP shards
    for phase in sliced.table:
        assert delta.table[phase]["resharding"] - sliced.table[phase]["resharding"] == pytest.approx(copies), phase
