"""The `placement:` and `async_training:` sections (issue 29): every rule they own, and the layout
rules that now count the rollout or the training ranks, refused at load in one line naming the
field and what is valid; the world a heterogeneous job adds up to."""
import pytest

from verl_hpc.config import ConfigError, load_config, validate

OK = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2"]
SPLIT = ["placement.mode=split"]
FOUR = ["slurm.nodes=2", "slurm.tasks_per_node=2"]  # a world of 4 ranks on 2 nodes


def loaded(overrides):
    cfg = load_config(None, OK + list(overrides))
    validate(cfg, check_model=False)
    return cfg


def refusal(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        loaded(overrides)
    assert len(e.value.problems) == 1, e.value.problems  # one rule broken, one line
    (text,) = e.value.problems
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("overrides,message", [
    # declared choices and ranges
    (["placement.mode=apart"], "placement.mode: invalid value 'apart'; valid: colocated, split"),
    # split needs rollout ranks, and leaves training ranks
    (SPLIT, "placement.mode = split needs placement.rollout_ranks (or rollout_nodes) > 0"),
    (SPLIT + ["placement.rollout_ranks=2"],
     "placement.rollout_ranks = 2 leaves no training rank in the world size 2 (slurm.nodes 1 * "
     "slurm.tasks_per_node 2): valid: 1..1"),
    (SPLIT + ["slurm.nodes=3", "slurm.tasks_per_node=2", "placement.rollout_ranks=4", "placement.rollout_nodes=1"],
     "placement.rollout_ranks = 4 disagrees with placement.rollout_nodes = 1 * slurm.tasks_per_node = 2: "
     "give one of them"),
    # a heterogeneous job takes whole nodes from the other partition
    (SPLIT + ["placement.rollout_ranks=1", "placement.rollout_partition=inference"],
     "placement.rollout_partition (a heterogeneous job) needs placement.rollout_nodes"),
    # the partition is written into an #SBATCH line
    (SPLIT + ["placement.rollout_nodes=1", "placement.rollout_partition='a\\b'"],
     "placement.rollout_partition: contains a backslash"),
    (SPLIT + ["placement.rollout_nodes=1", "placement.rollout_partition=a\nb"],
     "placement.rollout_partition: contains character '\\n'; valid: a one-line value"),
    (SPLIT + ["placement.rollout_ranks=1", "trainer.job=sft", "data.sft_files=[s.jsonl]"],
     "placement.mode = split is for trainer.job = rl (got sft)"),
    # colocated: the split fields would be ignored silently
    (["placement.rollout_ranks=1"], "placement.rollout_ranks = 1 is for placement.mode = split (now colocated)"),
    (["placement.rollout_nodes=1"], "placement.rollout_nodes = 1 is for placement.mode = split (now colocated)"),
    (["placement.rollout_partition=inference"],
     "placement.rollout_partition = 'inference' is for placement.mode = split (now colocated)"),
])
def test_placement_rules(overrides, message):
    text = refusal(overrides)
    assert text.startswith(message), text


@pytest.mark.parametrize("field", ["rollout_ranks", "rollout_nodes"])
def test_negative_rollout_ranks_or_nodes_are_refused_first(field):
    with pytest.raises(ConfigError) as e:
        loaded(SPLIT + ["placement.rollout_ranks=1", f"placement.{field}=-1"])
    assert e.value.problems[0] == f"placement.{field}: must be >= 0, got -1", e.value.problems
    # nothing downstream counts -1 rollout ranks as a third training rank
    assert not any("data-parallel" in line for line in e.value.problems), e.value.problems


def test_rollout_nodes_must_leave_a_training_node_of_the_allocation():
    with pytest.raises(ConfigError) as e:
        loaded(SPLIT + ["slurm.tasks_per_node=1", "slurm.nodes=2", "placement.rollout_nodes=2"])
    # rollout_ranks resolves to 2 of 2 ranks; the nodes' line says how to add rollout nodes instead
    assert e.value.problems == [
        "placement.rollout_ranks = 2 leaves no training rank in the world size 2 (slurm.nodes 2 * "
        "slurm.tasks_per_node 1): valid: 1..1",
        "placement.rollout_nodes = 2 leaves no training node of slurm.nodes = 2: valid: 1..1, or set "
        "placement.rollout_partition (a heterogeneous job adds the rollout nodes to slurm.nodes)"]


@pytest.mark.parametrize("overrides,message", [
    (["async_training.staleness=1"], "async_training.staleness = 1 needs placement.mode = split"),
    (["async_training.chunk_tokens=4"], "async_training.chunk_tokens = 4 needs placement.mode = split"),
    (SPLIT + ["placement.rollout_ranks=1", "async_training.staleness=65"], "async_training.staleness: must be in [0, 64]"),
    (SPLIT + ["placement.rollout_ranks=1", "async_training.chunk_tokens=-1"], "async_training.chunk_tokens: must be >= 0"),
    (SPLIT + ["placement.rollout_ranks=1", "data.max_response_length=16", "async_training.chunk_tokens=16"],
     "async_training.chunk_tokens = 16 is not below rollout.max_tokens = 16"),
    (SPLIT + ["placement.rollout_ranks=1", "algorithm.adv_estimator=remax"],
     "placement.mode = split does not run algorithm.adv_estimator = remax"),
    (SPLIT + ["placement.rollout_ranks=1", "trainer.rollback.enable=true", "checkpoint.save_every=1"],
     "placement.mode = split does not run trainer.rollback.enable = true"),
    (SPLIT + ["placement.rollout_ranks=1", "data.train_files=[]", "data.task_weights.schedule=plateau",
              "data.tasks={a: {train_files: [x.parquet]}, b: {train_files: [y.parquet]}}"],
     "placement.mode = split does not run data.task_weights.schedule = plateau"),
    (SPLIT + ["placement.rollout_ranks=1", "async_training.partial_rollout=keep"],
     "async_training.partial_rollout: invalid value 'keep'; valid: continue, abort"),
    (SPLIT + ["placement.rollout_ranks=1", "async_training.stale_groups=skip"],
     "async_training.stale_groups: invalid value 'skip'; valid: drop, wait"),
    (SPLIT + ["placement.rollout_ranks=1", "async_training.objective=ppo"], "async_training.objective: invalid value 'ppo'; valid: decoupled, behaviour"),
    # a wait past threading.TIMEOUT_MAX overflows in the job: a week at most, like every timeout
    (SPLIT + ["placement.rollout_ranks=1", "async_training.poll_timeout_s=1e10"],
     "async_training.poll_timeout_s: must be in [0, 604800]"),
])
def test_async_training_rules(overrides, message):
    text = refusal(overrides)
    assert text.startswith(message), text


# ------------------------------------------------------------------ the layouts count their own group
def test_rollout_tp_must_divide_the_rollout_ranks_not_the_world():
    text = refusal(SPLIT + FOUR + ["placement.rollout_ranks=3", "rollout.tp=2"])
    assert text.startswith("rollout.tp = 2 does not divide placement.rollout_ranks = 3") and "valid: 1, 3" in text, text
    loaded(SPLIT + FOUR + ["placement.rollout_ranks=2", "rollout.tp=2"])  # 1 replica of 2 ranks


def test_training_tp_pp_must_tile_the_training_ranks_not_the_world():
    text = refusal(SPLIT + FOUR + ["placement.rollout_ranks=1", "parallel.tp=2"])
    assert text.startswith("parallel.tp * parallel.pp = 2 * 1 = 2 does not divide the 3 training ranks"), text
    cfg = loaded(SPLIT + FOUR + ["placement.rollout_ranks=2", "parallel.tp=2"])
    assert (cfg.train_world_size, cfg.rollout_world_size, cfg.dp) == (2, 2, 1)


# ------------------------------------------------------------------ what slurm.nodes counts
def test_rollout_nodes_of_one_allocation_are_its_first_nodes():
    cfg = loaded(SPLIT + ["slurm.nodes=3", "slurm.tasks_per_node=2", "placement.rollout_nodes=1"])
    assert (cfg.world_size, cfg.placement.rollout_ranks, cfg.train_world_size, cfg.dp) == (6, 2, 4, 4)


def test_a_heterogeneous_job_adds_its_rollout_nodes_to_slurm_nodes():
    cfg = loaded(SPLIT + ["slurm.nodes=2", "slurm.tasks_per_node=2", "placement.rollout_nodes=3",
                          "placement.rollout_partition=inference"])
    assert (cfg.world_size, cfg.rollout_world_size, cfg.train_world_size, cfg.dp) == (10, 6, 4, 4)
    assert cfg.world_words == ("the world size 10 ((placement.rollout_nodes 3 + slurm.nodes 2) * "
                               "slurm.tasks_per_node 2)")
    # the training layout tiles slurm.nodes' ranks; the message says how the world was formed
    text = refusal(SPLIT + ["slurm.nodes=1", "slurm.tasks_per_node=2", "placement.rollout_nodes=1",
                            "placement.rollout_partition=inference", "parallel.tp=4"])
    assert text == ("parallel.tp * parallel.pp = 4 * 1 = 4 does not divide the 2 training ranks (the world size 4 "
                    "((placement.rollout_nodes 1 + slurm.nodes 1) * slurm.tasks_per_node 2) - "
                    "placement.rollout_ranks 2)"), text


def test_rollout_only_ranks_give_vllm_the_gpu_and_never_sleep():
    split = loaded(SPLIT + ["placement.rollout_ranks=1", "slurm.tasks_per_node=2"])
    colocated = loaded(["slurm.tasks_per_node=2"])
    assert split.rollout.gpu_memory_utilization == 0.9 and colocated.rollout.gpu_memory_utilization == 0.5
    assert loaded(SPLIT + ["placement.rollout_ranks=1", "slurm.tasks_per_node=2",
                           "rollout.gpu_memory_utilization=0.7"]).rollout.gpu_memory_utilization == 0.7
    # sleep mode frees the GPU for the actor between phases: on a GPU colocated, never on a rollout-only rank
    # (a colocated config's explicit `true` carries over to split placement and does nothing there)
    assert colocated.rollout.sleeps(gpu=True) and not split.rollout.sleeps(gpu=True, split=True)
    forced = loaded(SPLIT + ["placement.rollout_ranks=1", "slurm.tasks_per_node=2", "rollout.sleep_between_phases=true"])
    assert not forced.rollout.sleeps(gpu=True, split=True)


def test_resharding_rules():
    """The sliced sync runs in both placements; its delta option only colocated (split placement
    serves each rollout rank its slices from the first training rank's snapshot)."""
    split = SPLIT + FOUR + ["placement.rollout_ranks=2"]
    assert loaded(split + ["resharding.mode=sliced"]).resharding.mode == "sliced"
    assert "resharding.delta does not run with placement.mode = split" in refusal(
        split + ["resharding.delta=true"])
    assert "resharding.delta = true needs resharding.mode = sliced or auto" in refusal(
        ["resharding.mode=full", "resharding.delta=true"])
    assert loaded(["resharding.delta=true"]).resharding.delta
    assert "resharding.mode: invalid value 'slices'" in refusal(["resharding.mode=slices"])
