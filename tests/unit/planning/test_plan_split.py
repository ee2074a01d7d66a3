"""The memory plan of split placement (issue 29): the rollout ranks hold only vLLM, the training
ranks only the Megatron roles; each group is reported with its own peak and checked against the
limit on its own, and a node that holds ranks of both groups is checked as a whole."""
from pathlib import Path

import pytest

from verl_hpc import plan as plan_cli
from verl_hpc.config import load_config
from verl_hpc.planning import plan_job
from verl_hpc.planning import phases

REPO = Path(__file__).resolve().parents[3]
GRPO = str(REPO / "configs/grpo_8b.yaml")  # tp 2, 8 GPUs per node, vLLM asleep between phases
PPO = str(REPO / "configs/ppo_70b.yaml")  # actor + critic + reference, tp 8 pp 2
# 4 training ranks of tp 2 (dp 2) either alone or next to 4 rollout ranks on the same node
COLOCATED_4 = ["slurm.tasks_per_node=4"]
SPLIT_4_4 = ["placement.mode=split", "placement.rollout_ranks=4"]
ROLES = ("actor", "critic", "ref", "activations", "logits")
CPU = ["slurm.gpus_per_node=0", "parallel.backend=gloo", "parallel.sequence_parallel=false",
       "parallel.overlap_grad_reduce=null", "parallel.overlap_param_gather=null", "parallel.tp=1", "rollout.tp=1"]


def without(row, *components):
    return {k: v for k, v in row.items() if k not in components}


def test_training_group_plans_what_a_colocated_rank_of_the_same_layout_plans_for_training():
    colocated = plan_job(load_config(GRPO, COLOCATED_4))
    split = plan_job(load_config(GRPO, SPLIT_4_4))
    training = split.training
    assert (training.ranks, training.group) == (4, "training")
    assert list(training.table) == [p for p in phases.TRAINING_PHASES if p in colocated.table]
    # the colocated rank's training phases: those with vLLM asleep (0 device bytes) or not yet started
    train_phases = [p for p, row in colocated.table.items() if row["vllm"] == 0.0]
    assert {"build", "old_logprob", "ref_logprob", "update_actor", "checkpoint"} <= set(train_phases)
    for phase in train_phases:  # the same roles, activations, logits, overhead; no vLLM at all
        assert without(training.table[phase], "nccl") == pytest.approx(without(colocated.table[phase], "nccl")), phase
    # NCCL: the colocated rank holds vLLM's communicators, the split one the weights group instead;
    # either is the same constant in every row, so the peaks agree once it is set aside
    nccl = {name: p.table["build"]["nccl"] for name, p in (("colocated", colocated), ("split", training))}
    colocated_training_peak = max(colocated.phase_total(p) for p in train_phases) - nccl["colocated"]
    assert training.peak - nccl["split"] == pytest.approx(colocated_training_peak)
    assert training.peak_phase == "update_actor"
    # the weight sync: the actor's weights and the buckets, no vLLM weights beside them
    sync = training.table["weight_sync"]
    assert sync["vllm"] == 0.0 and sync["actor"] == colocated.table["weight_sync"]["actor"]
    # the full path's buckets, plus (sliced, the default) the first training rank's bucket cut for
    # each of the 4 rollout ranks at rollout.tp 2
    cfg = load_config(GRPO, SPLIT_4_4)
    full = plan_job(load_config(GRPO, COLOCATED_4 + ["resharding.mode=full"])).table["weight_sync"]["resharding"]
    assert sync["resharding"] == pytest.approx(full + cfg.resharding.bucket_mb * 2 ** 20 * 4 / cfg.rollout.tp)
    whole = plan_job(load_config(GRPO, SPLIT_4_4 + ["resharding.mode=full"])).training.table["weight_sync"]
    assert whole["resharding"] == full > 0


def test_rollout_group_holds_vllm_awake_and_no_megatron_state():
    cfg = load_config(PPO, ["placement.mode=split", "placement.rollout_nodes=2", "rollout.gpu_memory_utilization=0.9"])
    rollout = plan_job(cfg).rollout
    assert (rollout.ranks, list(rollout.table)) == (16, list(phases.ROLLOUT_PHASES))
    budget = 0.9 * rollout.limit
    for phase, row in rollout.table.items():
        assert all(row[c] == 0.0 for c in ROLES), (phase, row)  # no weights, gradients or optimizer states
        assert row["vllm"] == pytest.approx(budget), phase  # awake throughout: nothing sleeps, nothing else fits
    assert rollout.table["weight_sync"]["resharding"] > 0  # the received buckets, while generation goes on
    assert not any("sleep level" in n for n in rollout.notes)
    # host: the rank's process only; no offloaded role, no checkpoint snapshots, no sleeping vLLM
    from verl_hpc.planning import hardware

    assert set(rollout.host.values()) == {8 * hardware.HOST_PROCESS_BYTES_GPU}


def test_each_group_is_checked_against_the_limit_on_its_own():
    # vLLM's budget fills the rollout GPU; the training group fits
    greedy = plan_job(load_config(GRPO, SPLIT_4_4 + ["rollout.gpu_memory_utilization=0.99"]))
    assert greedy.training.fits() and not greedy.rollout.fits() and not greedy.fits()
    assert greedy.binding == "rollout" and greedy.checked_peak() == greedy.rollout.peak
    # without offload and recompute the 70B actor + critic do not fit; vLLM alone does
    off = ["parallel.recompute_granularity=none", "ref.param_offload=false"] + [
        f"{r}.{f}=false" for r in ("actor", "critic") for f in ("param_offload", "grad_offload", "optimizer_offload")]
    heavy = plan_job(load_config(PPO, ["placement.mode=split", "placement.rollout_nodes=1", "slurm.nodes=9"] + off))
    assert heavy.rollout.fits() and not heavy.training.fits() and heavy.binding == "training"


def test_a_node_holding_both_groups_is_checked_as_a_whole():
    # 4 rollout + 4 training ranks on one CPU node: each group's 4 ranks fit the RAM, all 8 do not
    # (the sizes are those of the whole logits, model.logits_chunk_tokens = 0)
    cfg = load_config(GRPO, CPU + SPLIT_4_4 + ["slurm.mem_gb=650", "model.logits_chunk_tokens=0"])
    plan = plan_job(cfg)
    assert plan.shared_node() == (4, 4)
    assert plan.rollout.fits() and plan.training.fits()
    assert plan.shared_node_host() == pytest.approx(plan.rollout.host_peak + plan.training.host_peak)
    assert not plan.fits() and plan.binding == "shared node"
    # 4 ranks per node, the rollout ranks on node 1: only each group's own check applies
    apart = plan_job(load_config(GRPO, CPU + ["placement.mode=split", "placement.rollout_nodes=1", "slurm.nodes=2",
                                              "slurm.tasks_per_node=4", "slurm.mem_gb=650"]))
    assert apart.shared_node() is None and apart.fits()


def test_split_communicators_are_each_groups_own_plus_the_weights_group():
    from verl_hpc.planning.comms import job_communicators

    cfg = load_config(GRPO, ["placement.mode=split", "placement.rollout_ranks=2"])  # 2 rollout + 6 training (dp 3)
    cfg.data.train_batch_size = 6
    training = {c.name: c.size for c in job_communicators(cfg, False, "training")}
    rollout = {c.name: c.size for c in job_communicators(cfg, False, "rollout")}
    assert training["world"] == training["intra_dist_opt"] == 6 and training["dp"] == 3
    assert rollout["world"] == rollout["vllm_world"] == 2 and rollout["vllm_tp"] == 2
    assert training["weights"] == rollout["weights"] == 3  # every rollout rank + the first training rank
    assert "vllm_world" not in training and "dp" not in rollout


def test_plan_cli_reports_both_groups_and_refuses_the_one_that_does_not_fit(capsys):
    assert plan_cli.main([GRPO, *SPLIT_4_4]) == 0
    out = capsys.readouterr().out
    for needle in ("rollout group (4 ranks): memory per rank, GPU, GiB\n", "host memory per node (4 rollout ranks)",
                   "training group (4 ranks): memory per rank, GPU, GiB (pipeline stage 0)",
                   "host memory per node (4 training ranks)", "memory plan (split): rollout group peak",
                   "; training group peak", "of 79.6 GiB GPU: fits", "note: rollout group: split placement"):
        assert needle in out, (needle, out)
    assert plan_cli.main([GRPO, *SPLIT_4_4, "rollout.gpu_memory_utilization=0.99"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("memory plan: rollout group peak") and "exceeds the 79.6 GiB GPU" in err[-1], err
    assert "largest component vllm" in err[-1]
