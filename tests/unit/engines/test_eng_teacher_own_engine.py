"""A teacher on an engine of its own (issue 67 item 12): docs say teacher.engine picks the teacher's
engine apart from the actor's, so a Gemma 3 teacher (no Megatron mapping) with teacher.engine = fsdp
beside a Megatron actor passes the pre-queue checks, and the trainer's builders make a Megatron
actor and an FSDP teacher whose log-probs equal a float64 transformers forward of the teacher."""
import pytest

from update_reference import hf_forward64, policy_batch

LOGP_TOL = 2e-5  # fp32 engine vs float64 transformers (the engines' parity bound)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("own_engine")
    return make_tiny_model(root / "student", "llama", layers=1), make_tiny_model(root / "teacher", "gemma3", layers=2)


def _cfg(student, teacher, *extra):
    from verl_hpc.config import load_config

    # share_prompts off: the packed layout on sliding-window layers is another item of the issue
    return load_config(None, ["trainer.job=rl", f"model.path={student}", "data.train_files=[t.parquet]",
                              "rollout.n=2", "parallel.engine=megatron", "teacher.enable=true",
                              f"teacher.model_path={teacher}", "data.max_prompt_length=64",
                              "data.max_response_length=64", "actor.share_prompts=off",
                              "actor.micro_batch_size=2", *extra])


def test_the_pre_queue_checks_take_the_teachers_own_engine(folders):
    from verl_hpc.config import validate
    from verl_hpc.launcher.preflight import model_problems

    cfg = _cfg(*folders, "teacher.engine=fsdp")
    validate(cfg)
    assert model_problems(cfg) == []
    # on the actor's engine (Megatron) the same teacher is refused, naming the way out
    (line,) = model_problems(_cfg(*folders, "teacher.engine=actor"))
    assert line.startswith("teacher.model_path: ") and "is not mapped into Megatron" in line


def test_a_megatron_actor_and_an_fsdp_teacher_are_built_and_the_teacher_scores(one_rank_world, folders):
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.trainer.roles import build_engine, build_teachers

    student, teacher = folders
    cfg = _cfg(student, teacher, "teacher.engine=fsdp")
    actor = build_engine("actor", cfg)
    assert type(actor.engine).__module__.startswith("verl_hpc.engines.megatron")
    teachers = build_teachers(cfg)
    (role,) = teachers.roles.values()
    assert isinstance(role.engine, FsdpEngine)
    batch = policy_batch(1)
    got = role.log_probs(batch)["teacher_log_probs"].double()
    want, _, _ = hf_forward64(teacher, batch, cfg.rollout.temperature)
    assert float((got - want).abs().max()) <= LOGP_TOL
