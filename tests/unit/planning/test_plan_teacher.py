"""The memory plan with an on-policy distillation teacher: frozen weights of its own folder's shape
in its own column (a 70B teacher of an 8B student holds the 70B's weights), its forward as a phase,
nothing in the checkpoint, host memory while idle with teacher.param_offload, and `python -m
verl_hpc.plan` printing it."""
import pytest

from verl_hpc.config import load_config
from verl_hpc.plan import main as plan_main
from verl_hpc.planning import plan_job
from verl_hpc.planning.model_shape import known_arch, stage_params
from verl_hpc.planning.training import Precision, model_state_bytes

RESIDENT = ["actor.param_offload=false", "actor.grad_offload=false", "actor.optimizer_offload=false"]


def _teacher(path, *extra):
    return load_config("configs/grpo_8b.yaml", [*RESIDENT, "teacher.enable=true", f"teacher.model_path={path}",
                                                *extra])


def _weights(plan, name):
    """The frozen model's bytes on the plan's stage (TP 2), by hand."""
    params = stage_params(known_arch(name), 2, 1, plan.stage, "lm")
    return model_state_bytes(params, Precision.of("bfloat16"), trainable=False, dp=4,
                             distributed_optimizer=True)["weights"]


def test_a_teacher_holds_its_own_models_weights_and_has_its_phase():
    plain = plan_job(load_config("configs/grpo_8b.yaml", RESIDENT))
    assert "teacher_logprob" not in plain.table and all(r["teacher"] == 0 for r in plain.table.values())
    same = plan_job(_teacher("/path/to/Meta-Llama-3-8B-Instruct"))
    big = plan_job(_teacher("/path/to/Meta-Llama-3-70B-Instruct"))
    for plan, name in ((same, "llama-3-8b"), (big, "llama-3-70b")):
        t = plan.table
        assert t["teacher_logprob"]["teacher"] == _weights(plan, name) > 1e9
        assert t["update_actor"]["teacher"] == t["teacher_logprob"]["teacher"]  # not offloaded: it stays
        assert plan.peak - plain.peak >= _weights(plan, name)
    assert big.table["teacher_logprob"]["teacher"] > 8 * same.table["teacher_logprob"]["teacher"]
    # frozen: the checkpoint holds nothing of it
    assert same.host["checkpoint"] == plain.host["checkpoint"]


def test_offload_empties_the_teacher_while_idle():
    plan = plan_job(_teacher("/path/to/Meta-Llama-3-70B-Instruct", "teacher.param_offload=true"))
    t = plan.table
    assert t["update_actor"]["teacher"] == 0 and t["rollout"]["teacher"] == 0
    assert t["teacher_logprob"]["teacher"] == _weights(plan, "llama-3-70b")


def test_the_plan_cli_prints_the_teacher(capsys):
    plan_main(["configs/grpo_8b.yaml", *RESIDENT, "teacher.enable=true",
               "teacher.model_path=/path/to/Meta-Llama-3-70B-Instruct", "--gpu-memory-gb", "80"])
    out = capsys.readouterr().out
    assert "teacher_logprob" in out and "teacher" in out.split("\n", 3)[-1]


def test_several_teachers_add_up_in_one_column():
    one = plan_job(_teacher("/path/to/Meta-Llama-3-8B-Instruct"))
    two = plan_job(_teacher("/path/to/Meta-Llama-3-8B-Instruct",
                            "teacher.by_data_source={code: /path/to/Meta-Llama-3-70B-Instruct}"))
    assert two.table["teacher_logprob"]["teacher"] == _weights(two, "llama-3-8b") + _weights(two, "llama-3-70b")
    assert two.table["teacher_logprob"]["teacher"] > one.table["teacher_logprob"]["teacher"]
    # the forward's working bytes: the larger teacher's (one layer's intermediates grow with its width)
    assert two.table["teacher_logprob"]["activations"] > one.table["teacher_logprob"]["activations"]
    only_map = plan_job(_teacher("''", "teacher.by_data_source={code: /path/to/Meta-Llama-3-70B-Instruct}"))
    assert only_map.table["teacher_logprob"]["teacher"] == _weights(only_map, "llama-3-70b")


def test_the_step_time_counts_the_teachers_forward_at_its_size():
    from verl_hpc.planning import hardware
    from verl_hpc.planning.model_shape import total_params
    from verl_hpc.planning.suggest import step_time_parts

    base = load_config("configs/grpo_8b.yaml", RESIDENT)
    gpu = hardware.gpu_type("h100")
    big = _teacher("/path/to/Meta-Llama-3-70B-Instruct")
    tokens = base.data.train_batch_size * base.rollout.n * (base.data.max_prompt_length + base.data.max_response_length)
    flops = gpu.bf16_tflops * 1e12 * base.train_world_size * hardware.ASSUMED_TRAIN_MFU
    added = step_time_parts(big, gpu)["forwards"] - step_time_parts(base, gpu)["forwards"]
    assert added == pytest.approx(2 * total_params(known_arch("llama-3-70b")) * tokens / flops)


def test_offload_suggestions_switch_the_teacher_only_where_there_is_one():
    from verl_hpc.planning.suggest import Candidate, _apply

    cfg = _teacher("/path/to/Meta-Llama-3-70B-Instruct")
    assert _apply(cfg, 2, 1, None, "none", True, 4096).teacher.param_offload is True
    with_teacher = Candidate(2, 1, None, "none", True, 4096, 1.0, 1.0, 1.0, teacher=True).overrides()
    without = Candidate(2, 1, None, "none", True, 4096, 1.0, 1.0, 1.0).overrides()
    assert "teacher.param_offload=true" in with_teacher and "teacher" not in without
    plain = load_config("configs/grpo_8b.yaml", RESIDENT)
    assert _apply(plain, 2, 1, None, "none", True, 4096).teacher.param_offload is False  # no teacher: untouched


def test_split_placement_plans_the_teacher_on_the_training_group_only():
    """placement.mode = split: the teacher is built beside the actor on the training ranks; the
    rollout ranks hold vLLM alone."""
    split = ["placement.mode=split", "placement.rollout_ranks=4"]
    plan = plan_job(_teacher("/path/to/Meta-Llama-3-70B-Instruct", *split))
    training, rollout = plan.groups["training"], plan.groups["rollout"]
    assert training.table["teacher_logprob"]["teacher"] > 1e9
    assert training.table["update_actor"]["teacher"] == training.table["teacher_logprob"]["teacher"]
    assert "teacher_logprob" not in rollout.table and all(r["teacher"] == 0 for r in rollout.table.values())
    plain = plan_job(load_config("configs/grpo_8b.yaml", [*RESIDENT, *split])).groups
    assert rollout.peak == plain["rollout"].peak and training.peak > plain["training"].peak
