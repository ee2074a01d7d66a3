"""`make demo-distill`: a smaller student distilled on-policy from a stronger teacher, against GRPO alone.

    python -m verl_hpc.trainer.programs.demo_distill [--out outputs/demo_distill] [--teacher-steps 60]
                                                     [--student-layers 1] [overrides for the two student runs ...]

Steps, each a command of its own (verl_hpc/trainer/programs/demo.py's, on the same synthetic task):
  1. the teacher: `make demo`'s 2-layer tiny model, its noisy SFT warm start, then --teacher-steps of
     GRPO (configs/demo_rl.yaml), exported as a Hugging Face folder OUT/teacher;
  2. the student: a smaller tiny model (--student-layers, another seed, every tiny model's
     tokenizer) with the same noisy SFT warm start (OUT/student_sft/hf);
  3. from that warm start, two RL runs with the same seeds and steps: configs/demo_distill.yaml
     (GRPO on the task's rewards plus the teacher's per-token reverse KL as a dense reward) and
     configs/demo_distill_grpo.yaml (GRPO on the rewards alone).
Prints the teacher's greedy validation accuracy and both students' at every validation step, which
of the two reaches the higher accuracy and the first step it got there, and draws both curves (the
teacher's accuracy as a dashed line) in one plot, OUT/compare_demo_distill_vs_demo_distill_grpo.png.
The exit code is 0 whichever wins: the demo reports, it does not assert an outcome.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from verl_hpc.trainer.programs.demo import TASKS, steps_to_best, sh

DISTILL, GRPO = "configs/demo_distill.yaml", "configs/demo_distill_grpo.yaml"


def validation(history, metric: str = "val/acc/all"):
    """{step: value} of the rows that validated."""
    return {r["step"]: r[metric] for r in history if isinstance(r.get(metric), (int, float))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/demo_distill")
    ap.add_argument("--teacher-steps", type=int, default=60, help="GRPO steps that make the teacher")
    ap.add_argument("--student-layers", type=int, default=1, help="the student's decoder layers (the teacher has 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="dotted overrides for the two student runs, e.g. trainer.total_steps=80")
    a = ap.parse_args(argv)
    if a.teacher_steps < 1 or a.student_layers < 1:
        ap.error(f"--teacher-steps and --student-layers: got {a.teacher_steps} and {a.student_layers}; valid: >= 1")
    out, py, t0 = Path(a.out), sys.executable, time.time()
    task = TASKS["arith"]
    for phase in ("sft", "teacher_rl", "teacher", "student_sft", "distill", "distill_grpo"):
        shutil.rmtree(out / phase, ignore_errors=True)  # a rerun starts over
    data = [f"data.train_files=[{out}/data/train.parquet]", f"data.val_files=[{out}/data/val.parquet]"]
    submit = [py, "-m", "verl_hpc.submit"]

    # 1. the teacher: the main demo's model and warm start, then GRPO
    sh([py, "-m", "verl_hpc.models.tiny", str(out / "model"), "--layers", "2", "--seed", str(a.seed)], "teacher's model")
    sh([py, "-m", "verl_hpc.data.prepare", "synthetic", str(out / "data"), "--n-train", "2000", "--n-val", "100",
        "--seed", str(a.seed), "--sft-noise", str(task["sft_noise"])], "synthetic data")
    sft = lambda model, to: [*submit, task["sft_config"], "--local", *data, f"model.path={model}",  # noqa: E731
                             f"data.sft_files=[{out}/data/sft.parquet]", f"trainer.output_dir={to}",
                             f"trainer.hf_output_dir={to}/hf"]
    sh(sft(out / "model", out / "sft"), "teacher's SFT warm start")
    sh([*submit, task["rl_config"], "--local", *data, f"model.path={out}/sft/hf", f"trainer.output_dir={out}/teacher_rl",
        f"trainer.total_steps={a.teacher_steps}", f"trainer.val_every={a.teacher_steps}"], "teacher's GRPO")
    sh([py, "-m", "verl_hpc.checkpoint", "export", str(out / "teacher_rl" / "checkpoints" / f"step_{a.teacher_steps:06d}"),
        "--hf", str(out / "teacher"), "--model", str(out / "sft" / "hf"), "--overwrite"], "export the teacher")
    teacher_acc = json.loads((out / "teacher_rl" / "rl_summary.json").read_text())["val_after"]["val/acc/all"]

    # 2. the student: smaller, the same noisy warm start
    sh([py, "-m", "verl_hpc.models.tiny", str(out / "student_model"), "--layers", str(a.student_layers),
        "--seed", str(a.seed + 1)], "student's model")
    sh(sft(out / "student_model", out / "student_sft"), "student's SFT warm start")

    # 3. the student's two RL runs: with the teacher, and GRPO alone
    runs = {}
    for config in (DISTILL, GRPO):
        name = Path(config).stem
        runs[name] = out / name.replace("demo_", "")
        sh([*submit, config, "--local", *data, f"model.path={out}/student_sft/hf", f"teacher.model_path={out}/teacher",
            f"trainer.output_dir={runs[name]}", *a.overrides], f"student RL ({name})")
    report(out, runs, teacher_acc, time.time() - t0)
    return 0


def report(out: Path, runs, teacher_acc: float, seconds: float) -> None:
    from verl_hpc.tracking import read_history
    from verl_hpc.tracking.plots import write_comparison

    histories = {name: read_history(folder / "metrics.jsonl") for name, folder in runs.items()}
    labels = {"demo_distill": "student: GRPO + teacher (reverse KL per token)",
              "demo_distill_grpo": "student: GRPO from rewards alone"}
    path = write_comparison({labels.get(k, k): h for k, h in histories.items()}, "val/acc/all",
                            out / "compare_demo_distill_vs_demo_distill_grpo.png",
                            title="on-policy distillation vs GRPO: greedy validation accuracy",
                            ylabel="accuracy", hlines={"teacher (2 layers, GRPO-trained)": teacher_acc})
    vals = {k: validation(h) for k, h in histories.items()}
    print("\n" + "=" * 72)
    print(f"greedy validation accuracy ({out}/data/val.parquet); teacher: {100 * teacher_acc:.1f}%")
    print("  step   " + "   ".join(f"{k:>18}" for k in vals))
    for step in sorted(set().union(*vals.values())):
        print(f"  {step:4d}   " + "   ".join(f"{100 * v[step]:17.1f}%" if step in v else f"{'':>18}"
                                             for v in vals.values()))
    best = {k: steps_to_best(h) for k, h in histories.items()}
    for k, b in best.items():
        if b:
            kl = [r["teacher/kl"] for r in histories[k] if "teacher/kl" in r]
            extra = f"; teacher/kl per token {kl[0]:.3f} -> {kl[-1]:.3f}" if kl else ""
            print(f"  {k}: best {100 * b[0]:5.1f}% first at step {b[1]}{extra}")
    if all(best.values()):
        (a, ba), (b, bb) = best.items()
        if (ba[0], -ba[1]) == (bb[0], -bb[1]):
            print("  a tie: the same best accuracy at the same step")
        else:
            win = a if (ba[0], -ba[1]) > (bb[0], -bb[1]) else b
            print(f"  higher best accuracy (earlier on a tie): {win}")
    print(f"comparison plot: {path}")
    print(f"wall time: {seconds:.0f}s")
    print("=" * 72)


if __name__ == "__main__":
    sys.exit(main())
