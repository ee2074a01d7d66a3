"""The teacher section (on-policy distillation): off by default; its rules name the field and what
is valid; the teacher role's engine options; and a teacher whose tokenizer is not the student's is
refused at load in one line naming both folders."""
import functools
import shutil

import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.validate import validate
from verl_hpc.trainer.roles import engine_options

import config_checks

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "algorithm.recipe=grpo",
        "actor.use_kl_loss=false"]
ON = ["teacher.enable=true", "teacher.model_path=/teacher"]
SHORT = ["data.max_prompt_length=64", "data.max_response_length=64"]  # within the tiny models' 256 positions


problems = functools.partial(config_checks.refused, base=BASE)


def test_off_by_default_and_on_with_a_folder():
    cfg = load_config(None, BASE)
    assert not cfg.teacher.enable and cfg.teacher.mode == "reward" and cfg.teacher.coef == 1.0
    validate(load_config(None, [*BASE, *ON]), check_model=False)  # a valid distillation job
    validate(load_config(None, [*BASE, *ON, "teacher.mode=loss", "teacher.coef=0.5"]), check_model=False)
    # split placement: the teacher lives on the training group's ranks, beside the actor
    validate(load_config(None, [*BASE, *ON, "placement.mode=split", "placement.rollout_ranks=1",
                                "slurm.tasks_per_node=2"]), check_model=False)


@pytest.mark.parametrize("overrides, wanted", [
    (["teacher.enable=true"], "teacher.model_path: empty; teacher.enable needs the teacher's Hugging Face folder"),
    ([*ON, "teacher.coef=0"], "teacher.coef = 0: the teacher would change nothing"),
    ([*ON, "teacher.coef=-1"], "teacher.coef: must be >= 0, got -1"),
    ([*ON, "teacher.mode=kl"], "teacher.mode"),
    ([*ON, "teacher.engine=vllm"], "teacher.engine"),
    ([*ON, "algorithm.recipe=ppo"], "teacher.mode = reward adds the distillation advantage per token and takes "
                                    "no critic, but algorithm.adv_estimator = gae"),
])
def test_rules_name_the_field(overrides, wanted):
    found = problems(*overrides)
    assert any(wanted in p for p in found), found


def test_a_teacher_outside_rl_is_refused():
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["trainer.job=sft", "model.path=/m", "data.sft_files=[x.parquet]", *ON]),
                 check_model=False)
    assert any("teacher.enable: on-policy distillation scores sampled responses" in p for p in e.value.problems)


def test_engine_options_of_the_teacher_role():
    cfg = load_config(None, [*BASE, *ON, "teacher.param_offload=true", "actor.micro_batch_size=2",
                             "rollout.temperature=0.7"])
    o = engine_options(cfg, "teacher")
    assert (o.model_path, o.head, o.trainable, o.optim, o.lora) == ("/teacher", "lm", False, None, None)
    assert (o.param_offload, o.micro_batch_size, o.temperature) == (True, 2, 0.7)
    assert cfg.teacher.engine_for(cfg) == "megatron"  # the actor's (parallel.engine's default)
    fsdp = load_config(None, [*BASE, *ON, "parallel.engine=fsdp"])
    assert fsdp.teacher.engine_for(fsdp) == "fsdp"
    assert load_config(None, [*BASE, *ON, "teacher.engine=fsdp"]).teacher.engine_for(cfg) == "fsdp"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A student, a bigger teacher sharing its tokenizer, and a model with another tokenizer."""
    from verl_hpc.models.tiny import make_tiny_model, train_tokenizer

    root = tmp_path_factory.mktemp("teacher_folders")
    student = make_tiny_model(root / "student", "llama", layers=2)
    teacher = make_tiny_model(root / "teacher", "llama", layers=3, seed=1)
    stranger = root / "stranger"
    shutil.copytree(student, stranger)
    for f in stranger.glob("*token*"):
        f.unlink()
    train_tokenizer(vocab_size=480, seed=1).save_pretrained(stranger)  # another corpus: another vocabulary
    return student, teacher, stranger


def test_a_teacher_with_the_students_tokenizer_loads(folders):
    student, teacher, _ = folders
    validate(load_config(None, [*BASE, *SHORT, f"model.path={student}", "teacher.enable=true",
                                f"teacher.model_path={teacher}"]), check_model=True)


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line_naming_both(folders):
    student, _, stranger = folders
    found = problems(*SHORT, f"model.path={student}", "teacher.enable=true", f"teacher.model_path={stranger}",
                     check_model=True)
    assert len(found) == 1 and "\n" not in found[0], found
    line = found[0]
    assert line.startswith("teacher.model_path: the teacher's tokenizer") and "vocabularies differ" in line
    assert f"({stranger})" in line and f"(model.tokenizer_path: {student})" in line


def test_a_missing_teacher_folder_is_named():
    found = problems(*ON, check_model=True)
    assert "teacher.model_path: no such folder '/teacher'" in found


def test_several_teachers_by_data_source(folders):
    student, teacher, stranger = folders
    cfg = load_config(None, [*BASE, *SHORT, f"model.path={student}", "teacher.enable=true",
                             f"teacher.by_data_source={{code: {teacher}}}"])
    validate(cfg, check_model=True)  # no default teacher: every source must then be listed (checked on the data)
    assert cfg.teacher.folder_of("code") == str(teacher) and cfg.teacher.folder_of("math") == ""
    assert problems("teacher.enable=true", "teacher.by_data_source={code: ''}")[0].startswith(
        "teacher.by_data_source.code: empty folder")
    found = problems(*SHORT, f"model.path={student}", "teacher.enable=true", f"teacher.model_path={teacher}",
                     f"teacher.by_data_source={{code: {stranger}, math: /nowhere}}", check_model=True)
    assert len(found) == 2, found
    assert found[0].startswith(f"teacher.by_data_source.code: the teacher's tokenizer ({stranger})")
    assert found[1] == "teacher.by_data_source.math: no such folder '/nowhere'"
