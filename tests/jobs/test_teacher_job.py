"""On-policy distillation through the user's entry point (one rank in this process, tests/jobs.py):
a GRPO job with a teacher (a bigger tiny model of the student's tokenizer) runs in either mode and
logs teacher/kl, the mean reverse KL per token, every step; in loss mode the actor's own term on
one on-policy mini-batch is that same KL; a run with a teacher resumes bitwise (the teacher is not
in the checkpoint, only its folder's fingerprint), and a resume with another teacher is refused. A
teacher with another tokenizer stops the job in one `error:` line naming both folders. And it
learns: distillation from the SFT warm start into a flattened copy of it brings teacher/kl down."""
import math
import shutil

import pytest

import torch

from jobs import logs, metrics, read_all, run_here, small, stable_metrics, straight_and_resumed


@pytest.fixture(scope="module")
def teachers(tiny_assets, tmp_path_factory):
    """(a teacher sharing the student's tokenizer, a model with another tokenizer, another teacher)."""
    from verl_hpc.models.tiny import make_tiny_model, train_tokenizer

    root = tmp_path_factory.mktemp("teachers")
    teacher = make_tiny_model(root / "teacher", "llama", layers=3, seed=1)
    stranger = root / "stranger"
    shutil.copytree(teacher, stranger)
    for f in stranger.glob("*token*"):
        f.unlink()
    train_tokenizer(vocab_size=480, seed=1).save_pretrained(stranger)
    return teacher, stranger, make_tiny_model(root / "other", "llama", layers=3, seed=2)


def _run(tiny_assets, out, teacher, *extra):
    return run_here("configs/demo_rl.yaml", out, *small(tiny_assets, "algorithm.recipe=grpo", "rollout.n=2",
                                                        "teacher.enable=true", f"teacher.model_path={teacher}",
                                                        *extra))


def test_reward_mode_job_logs_teacher_kl_every_step(tiny_assets, teachers, tmp_path):
    proc, summary = _run(tiny_assets, tmp_path / "out", teachers[0], "teacher.coef=0.5")
    assert proc.returncode == 0, logs(proc, tmp_path / "out")
    rows = [r for r in metrics(tmp_path / "out") if r.get("step", 0) >= 1]
    assert summary["steps"] == 3 and len(rows) == 3
    for r in rows:
        assert math.isfinite(r["teacher/kl"]) and r["teacher/kl"] != 0, r
        assert r["teacher/log_prob_mean"] < 0 and "timing_s/teacher" in r and "actor/pg_loss" in r
        assert "actor/teacher_kl_loss" not in r  # reward mode: no loss term
    assert "roles: actor, teacher" in proc.stderr + proc.stdout
    from verl_hpc.tracking import write_plots

    assert "Distillation" in write_plots(rows, tmp_path / "curves.png").panels


def test_loss_mode_term_is_the_logged_kl_on_policy(tiny_assets, teachers, tmp_path):
    # one mini-batch of the step's 4 x 2 sequences: the update's first forward is pi_old's
    proc, _ = _run(tiny_assets, tmp_path / "out", teachers[0], "teacher.mode=loss", "teacher.coef=0.5",
                   "trainer.total_steps=2", "actor.ppo_mini_batch_size=4")
    assert proc.returncode == 0, logs(proc, tmp_path / "out")
    rows = [r for r in metrics(tmp_path / "out") if r.get("step", 0) >= 1]
    assert len(rows) == 2
    for r in rows:
        kl, term = r["teacher/kl"], r["actor/teacher_kl_loss"]
        assert math.isfinite(kl) and kl != 0
        assert abs(term - kl) <= 1e-4 * max(1.0, abs(kl)), (term, kl)


def test_a_teacher_with_another_tokenizer_stops_the_job_in_one_line(tiny_assets, teachers, tmp_path):
    proc, _ = _run(tiny_assets, tmp_path / "out", teachers[1])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "teacher.model_path: the teacher's tokenizer" in errors[0]
    assert str(teachers[1]) in errors[0] and f"{tiny_assets}/model" in errors[0]
    assert "Traceback" not in proc.stderr


def test_resume_is_bitwise_with_a_teacher_and_another_teacher_is_refused(tiny_assets, teachers, tmp_path):
    straight, split, _ = straight_and_resumed(lambda out, *extra: _run(tiny_assets, out, teachers[0], *extra), tmp_path)
    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b) and not any(n.startswith("teacher") for n in a)  # frozen: not saved
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    first = read_all(split / "checkpoints" / "step_000001")
    assert any(not torch.equal(first[n], a[n]) for n in a if n.startswith("actor/model/")), "weights never moved"
    assert stable_metrics(straight) == stable_metrics(split)  # mem_* are volatile: this process's memory
    from verl_hpc.checkpoint import read_metadata

    record = read_metadata(split / "checkpoints")["trainer_state"]["teacher"]["teacher.model_path"]
    assert record["path"] == str(teachers[0]) and len(record["fingerprint"]) == 64
    # the same checkpoint resumed with another teacher: refused, naming the field and both folders
    proc, _ = _run(tiny_assets, split, teachers[2], "trainer.total_steps=4")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert f"the checkpoint was trained with the teacher at {teachers[0]}" in errors[0]
    assert f"teacher.model_path = {teachers[2]}" in errors[0]


def test_teachers_by_data_source_through_the_job(tiny_assets, teachers, tmp_path):
    """teacher.by_data_source without teacher.model_path: the task's one source has its teacher
    (teacher/kl/<source> logged); a map that leaves it out stops the job before the first step."""
    common = ["trainer.total_steps=1", "teacher.model_path=''"]
    proc, _ = _run(tiny_assets, tmp_path / "ok", "''", *common,
                   f"teacher.by_data_source={{synthetic_arith: {teachers[0]}}}")
    assert proc.returncode == 0, logs(proc, tmp_path / "ok")
    row = [r for r in metrics(tmp_path / "ok") if r.get("step", 0) >= 1][0]
    assert row["teacher/kl/synthetic_arith"] == pytest.approx(row["teacher/kl"], rel=1e-9)
    proc, _ = _run(tiny_assets, tmp_path / "missing", "''", *common, f"teacher.by_data_source={{code: {teachers[0]}}}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "teacher.by_data_source: no teacher for data_source 'synthetic_arith' (listed: code)" in errors[0]


def _scaled_head(model, out, factor):
    """A copy of the HF folder `model` with its lm head x `factor` (sharper above 1, flatter below)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * factor
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.numerics
def test_distillation_moves_the_student_toward_the_teacher(warm_assets, tmp_path):
    """Learning, not only plumbing: the teacher is the SFT warm start, the student the same model with
    its lm head halved (the teacher's ranking of every next token, flatter). On-policy distillation
    alone (GRPO's advantages of the task rewards are there too, but cannot tell the two apart) brings
    teacher/kl per token, measured on each step's fresh samples before its update, well below the
    same run's with the teacher's signal scaled to nothing (coef 1e-6)."""
    student = _scaled_head(warm_assets / "sft" / "hf", tmp_path / "student", 0.5)

    def kl(name, coef):
        out = tmp_path / name
        proc, _ = run_here("configs/demo_rl.yaml", out, *small(
            warm_assets, f"model.path={student}", "algorithm.recipe=grpo", "teacher.enable=true",
            f"teacher.model_path={warm_assets}/sft/hf", f"teacher.coef={coef}", "trainer.total_steps=8",
            "actor.optim.lr=1e-3", "actor.optim.lr_decay_style=constant", "data.train_batch_size=8", "rollout.n=4",
            "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=16", "tracking.plots=false"))
        assert proc.returncode == 0, logs(proc, out)
        return [r["teacher/kl"] for r in metrics(out) if r.get("step", 0) >= 1]

    taught, control = kl("taught", 1.0), kl("control", 1e-6)
    print("teacher/kl per step, taught:", taught, "control:", control)
    assert len(taught) == len(control) == 8
    assert taught[0] == pytest.approx(control[0], rel=1e-6)  # the same first samples, before any update
    # One step's estimate is noisy (32 samples of a few tokens): the last 3 steps' mean, against the
    # control's last 3, whose first samples are the same. Measured over 8 data/sampling seeds and MKL
    # code paths (16 runs: 8 seeds with an AVX-512 CPU's warm start, 4 with an AVX2 warm start and
    # runs, 4 under COMPATIBLE or AVX512 or one thread): 0.16-0.65 (here: 0.42 / 1.19 = 0.35; 0.57 on
    # an AMD EPYC machine, where the bound of 0.5 this test had failed). Neither run is a fixed line
    # to measure against alone: the first step's estimate ranged 0.55-1.62 by seed, the taught run
    # ended at 0.24-0.79 of it, and the control, which GRPO's own updates move too, at 0.66-3.5.
    late = lambda xs: sum(xs[-3:]) / 3  # noqa: E731
    assert late(taught) < 0.8 * late(control), (taught, control)
