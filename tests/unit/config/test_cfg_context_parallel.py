"""parallel.cp (Megatron's context parallelism) in the config: the layout tp * cp * pp * dp = the
training ranks, and the combinations that cannot run refused with one line each."""
import pytest

from verl_hpc.config import ConfigError, load_config, validate

# a GPU job of 8 ranks: only then can parallel.cp > 1 pass (Transformer Engine's attention)
GPU = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2", "slurm.tasks_per_node=8",
       "slurm.gpus_per_node=8", "data.train_batch_size=8",
       "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=1"]


def only_problem(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, GPU + overrides), check_model=False)
    assert len(info.value.problems) == 1, str(info.value)
    return info.value.problems[0]


@pytest.mark.parametrize("tp, cp, pp, dp", [(1, 2, 1, 4), (2, 2, 1, 2), (2, 2, 2, 1), (1, 8, 1, 1), (1, 1, 1, 8)])
def test_cp_joins_the_layout(tp, cp, pp, dp):
    cfg = load_config(None, GPU + [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.pp={pp}"])
    validate(cfg, check_model=False)
    assert (cfg.layout.cp, cfg.dp) == (cp, dp)
    assert tp * cp * pp * cfg.dp == cfg.train_world_size


def test_cp_is_one_by_default():
    assert load_config(None, GPU).parallel.cp == 1


def test_cp_that_does_not_tile_names_the_valid_sizes():
    text = only_problem(["parallel.tp=2", "parallel.cp=3"])
    assert text.startswith("parallel.tp * parallel.pp * parallel.cp = 2 * 1 * 3 = 6 does not divide the world size 8")
    assert text.endswith("valid parallel.cp: 1, 2, 4")


def test_cp_on_a_cpu_job_is_refused():
    text = only_problem(["slurm.gpus_per_node=0", "parallel.cp=2"])
    assert text.startswith("parallel.cp = 2 needs Transformer Engine's attention (GPUs), but slurm.gpus_per_node = 0")


@pytest.mark.parametrize("engine", ["fsdp", "auto"])
def test_cp_needs_the_megatron_engine(engine):
    # fsdp: the fsdp section's own tp/pp rules do not cover cp; exactly one line names it
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, GPU + ["parallel.cp=2", f"parallel.engine={engine}"]), check_model=False)
    lines = [p for p in info.value.problems if "parallel.cp" in p]
    assert lines == [f"parallel.cp = 2 needs parallel.engine = megatron (got {engine}): it is Megatron-Core's "
                     "context parallelism; on the FSDP engine split long sequences with fsdp.sp (Ulysses)"]


def test_cp_counts_in_the_data_parallel_batch_rule():
    # 8 ranks / (tp 1 * cp 2) = dp 4: a batch of 3 prompts x 2 responses does not split over 4
    text = only_problem(["parallel.cp=2", "data.train_batch_size=3"])
    assert "4" in text and "data.train_batch_size" in text
