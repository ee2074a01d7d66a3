"""The distillation teacher as an engine role on one gloo rank, built as the trainer builds it
(verl_hpc/trainer/roles.py build_engine("teacher", cfg)) on the actor's engine, Megatron or FSDP: a
frozen model of its own folder (bigger than the student, another seed) whose log-probs of the
student's tokens equal a float64 transformers forward of the teacher, at rollout.temperature;
offloaded while idle (teacher.param_offload) with the same results."""
import pytest
import torch

from update_reference import hf_forward64, policy_batch

LOGP_TOL = 2e-5  # fp32 engine vs float64 transformers (the engines' parity bound)
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("teacher_engine")
    return (make_tiny_model(root / "student", "llama", layers=2),
            make_tiny_model(root / "teacher", "llama", layers=3, seed=1))


def _teacher(student, teacher, engine, *extra):
    from verl_hpc.config import load_config
    from verl_hpc.trainer.roles import build_engine

    cfg = load_config(None, ["trainer.job=rl", f"model.path={student}", "teacher.enable=true",
                             f"teacher.model_path={teacher}", f"parallel.engine={engine}",
                             f"rollout.temperature={TEMPERATURE}", "actor.micro_batch_size=3", *extra])
    return build_engine("teacher", cfg)


@pytest.mark.parametrize("engine", ["megatron", "fsdp"])
def test_teacher_log_probs_equal_float64_transformers(one_rank_world, folders, engine):
    from verl_hpc.engines.roles import Teacher

    student, teacher = folders
    role = _teacher(student, teacher, engine, "teacher.param_offload=true")
    assert isinstance(role, Teacher) and not role.engine.options.trainable
    assert role.engine.offloader.device_bytes()["params"] == 0  # idle: its weights offloaded
    batch = policy_batch(1)
    got = role.log_probs(batch)["teacher_log_probs"].double()
    assert role.engine.offloader.device_bytes()["params"] == 0  # and again after the forward
    want, _, mask = hf_forward64(teacher, batch, TEMPERATURE)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= LOGP_TOL
    assert bool((got[mask == 0] == 0).all())
    # the teacher's own weights, not the student's: the student's forward is far from them
    assert float((hf_forward64(student, batch, TEMPERATURE)[0] - want).abs().max()) > 100 * LOGP_TOL
    resident = _teacher(student, teacher, engine).log_probs(batch)["teacher_log_probs"]
    assert torch.equal(resident.double(), got)  # offload changes nothing
