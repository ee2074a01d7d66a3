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


def _step_batch(batch, sources):
    from verl_hpc.trainer.stages.step_batch import StepBatch

    n = len(sources)
    return StepBatch(input_ids=batch["input_ids"], prompt_lengths=batch["prompt_lengths"],
                     response_lengths=batch["response_lengths"], response_mask=batch["response_mask"],
                     ids=[str(i) for i in range(n)], data_sources=list(sources), ground_truths=[""] * n,
                     extras=[{}] * n, response_texts=[""] * n, group_ids=torch.arange(n),
                     rollout_log_probs=torch.zeros_like(batch["response_mask"]),
                     old_log_probs=batch["old_log_probs"])


def test_several_teachers_score_the_rows_of_their_data_sources(one_rank_world, folders, tmp_path):
    """teacher.by_data_source: each row's log-probs are its own source's teacher's (float64
    transformers of that folder), the rest go to teacher.model_path; teacher/kl per source."""
    from verl_hpc.config import load_config
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.trainer.roles import build_teachers
    from verl_hpc.trainer.stages.teacher_stage import TeacherStage

    student, teacher = folders
    coder = make_tiny_model(tmp_path / "coder", "llama", layers=2, seed=2)
    cfg = load_config(None, ["trainer.job=rl", f"model.path={student}", "teacher.enable=true",
                             f"teacher.model_path={teacher}", f"teacher.by_data_source={{code: {coder}}}",
                             f"rollout.temperature={TEMPERATURE}", "actor.micro_batch_size=3"])
    teachers = build_teachers(cfg)
    assert list(teachers.roles) == [str(teacher), str(coder)]
    raw = policy_batch(2)
    sources = ["math", "code", "code", "math", "gsm8k", "code", "math", "math"]
    batch = _step_batch(raw, sources)
    m = TeacherStage(teachers)(batch, lambda name: __import__("contextlib").nullcontext())
    got = batch.teacher_log_probs.double()
    want_t, _, mask = hf_forward64(teacher, raw, TEMPERATURE)
    want_c, _, _ = hf_forward64(coder, raw, TEMPERATURE)
    for i, s in enumerate(sources):
        want = want_c[i] if s == "code" else want_t[i]
        assert float((got[i] - want).abs().max()) <= LOGP_TOL, (i, s)
    assert bool((got[mask == 0] == 0).all())
    for s in ("math", "code", "gsm8k"):
        rows = [i for i, x in enumerate(sources) if x == s]
        kl = ((raw["old_log_probs"][rows].double() - got[rows]) * mask[rows]).sum() / mask[rows].sum()
        assert abs(m[f"teacher/kl/{s}"] - float(kl)) < 1e-5
    teachers.check_sources(["math", "code"])  # model_path takes every source not listed


def test_a_data_source_without_a_teacher_is_refused_in_one_line():
    from verl_hpc.config import ConfigError, load_config
    from verl_hpc.trainer.stages.teacher_stage import Teachers

    cfg = load_config(None, ["trainer.job=rl", "teacher.enable=true", "teacher.by_data_source={code: /c, math: /m}"])
    with pytest.raises(ConfigError) as e:
        Teachers({}, cfg.teacher).check_sources(["math", "gsm8k", "code", "arc"])
    line = str(e.value)
    assert "\n" not in line and line.startswith("teacher.by_data_source: no teacher for data_source 'arc', 'gsm8k'")
    assert "(listed: code, math)" in line


def test_a_loss_mode_update_equals_float64_transformers(one_rank_world, folders):
    """teacher.mode = loss through the Megatron engine's update (micro-batches of 3 of 8 rows):
    the weights after one step equal the same objective on the whole batch in float64
    transformers with torch's AdamW, and actor/teacher_kl_loss is the batch's mean reverse KL."""
    import dataclasses

    from update_reference import hf_update64, max_diff
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config import load_config
    from verl_hpc.config.schema import ActorConfig, OptimConfig
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.engines.options import default_options
    from verl_hpc.engines.roles import Actor

    student, teacher = folders
    batch = policy_batch(3)
    batch["teacher_log_probs"] = _teacher(student, teacher, "megatron").log_probs(batch)["teacher_log_probs"]
    cfg = load_config(None, ["teacher.enable=true", "teacher.mode=loss", "teacher.coef=0.5"])
    acfg = ActorConfig(ppo_mini_batch_size=8)
    objective = PolicyObjective.from_config(acfg, cfg.teacher)
    assert objective.distill_coef == 0.5
    optim = OptimConfig(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.01)  # a step that measures gradients
    engine = MegatronEngine(default_options(str(student), optim=optim, micro_batch_size=3, temperature=TEMPERATURE,
                                            total_steps=4))
    start = engine.forward(batch, ("log_probs",))["log_probs"].double()
    mask = batch["response_mask"]
    kl = float(((start - batch["teacher_log_probs"].double()) * mask).sum() / mask.sum())
    metrics = Actor(engine, acfg).update(batch, objective)
    assert metrics["actor/teacher_kl_loss"] == pytest.approx(kl, rel=1e-5)
    got = {n: t.clone() for n, t in engine.export_hf_weights()}
    want, _ = hf_update64(student, batch, objective, optim, TEMPERATURE)
    assert max_diff(got, want) <= 1e-5
    # the term matters: without it the step lands elsewhere
    plain, _ = hf_update64(student, batch, dataclasses.replace(objective, distill_coef=0.0), optim, TEMPERATURE)
    assert max_diff(plain, want) > 1e-3
