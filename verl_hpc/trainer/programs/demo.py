"""`make demo`: a tiny model learns "3+4=" -> "7" with SFT on noisy labels, then GRPO fixes it.

    python -m verl_hpc.trainer.programs.demo [--out outputs/demo] [--ranks N] [--rl-config C] [overrides ...]

Steps, each a separate command you can also run by hand:
  1. python -m verl_hpc.models.tiny OUT/model                     a random-init tiny Llama + tokenizer
  2. python -m verl_hpc.data.prepare synthetic OUT/data ...        train/val/sft parquet, noisy SFT labels
  3. python -m verl_hpc.submit configs/demo_sft.yaml --local       SFT warm start -> OUT/sft/hf
  4. python -m verl_hpc.submit configs/demo_rl.yaml --local        GRPO from OUT/sft/hf, validated
     (--rl-config configs/demo_rl_split.yaml: the same in split placement, asynchronous)
Prints validation accuracy before and after the RL phase and where the plot is; exits 1 when the
rise is under --min-rise points. --family qwen3_moe (make demo-moe): the same with a tiny
mixture-of-experts model, trained at expert parallel 2 (configs/demo_moe.yaml).

--compare C: a second RL phase from the same warm start with config C (same seeds and steps), e.g.
configs/demo_prime.yaml against its outcome-only baseline configs/demo_prime_rloo.yaml (make
demo-prime); prints each run's best validation accuracy and the first step that reached it, and
draws both validation curves in one plot, OUT/compare_<a>_vs_<b>.png, and where the runs measured it
the rollout/training mismatch KL per step, OUT/compare_<a>_vs_<b>_kl.png (make demo-fp8: the float32
rollout against the FP8 one, configs/demo_rl_fp8.yaml).

--task visual (make demo-vlm; outputs/demo_vlm): a tiny random-initialised Qwen2.5-VL (vision tower,
projector, language model; verl_hpc/models/tiny_vlm.py) names the colour of the largest shape in
small pictures drawn with Pillow (prepare/visual.py; the task's other kinds, dots and bars, are
beyond the tiny model): SFT on noisy labels, then GRPO on the FSDP engine with the images in every
rollout and update (the override parallel.engine=megatron runs both phases on the Megatron engine).
It also writes OUT/val_answers.png, validation pictures with the answers before and after RL.

--task judge (make demo-judge; outputs/demo_judge): the arithmetic demo, its RL phase rewarded only
by a generative judge trained here (verl_hpc/trainer/programs/demo_judge.py, configs/demo_judge.yaml);
it also prints the judge's held-out accuracy and its agreement with the rule during RL.

--task agent (make demo-agent; outputs/demo_agent): the arithmetic demo, its RL phase run through an
agent program that knows only the `openai` client (demo_agent_solver.py: draft, a check of its own,
a second call with its history truncated), served by the job's endpoint (configs/demo_agent.yaml);
it also prints the runs' calls, merges, splits and failures.

--task tool: the tool demo instead (make demo-tool; outputs/demo_tool): 5-digit products that the
tiny model gets right only by calling `calculator` in a multi-turn episode. Data from
`python -m verl_hpc.data.prepare tool_arith` (multi-turn SFT demonstrations, most replaced by direct
answers), SFT with configs/demo_tool_sft.yaml, GRPO over episodes with configs/demo_tool.yaml; it
also prints the tool-call rate before and after (verl_hpc/data/prepare/tool_arith.py says why).

Why the noise: a fraction (--sft-noise, > 0.5) of SFT labels is the sum plus one, so the warm start
answers "3+4=" with "8" greedily while still giving "7" some probability. GRPO samples both, rewards
the right one, and greedy accuracy climbs (verl_hpc/data/prepare/synthetic.py explains the choice).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


# the demo's tasks: data generator (and its further arguments), the SFT and RL configs, SFT noise, output folder
TASKS = {
    "arith": dict(data="synthetic", data_args=(), sft_config="configs/demo_sft.yaml",
                  rl_config="configs/demo_rl.yaml", sft_noise=0.62, out="outputs/demo"),
    # 4,000 SFT rows, 3 in 4 of them direct answers: greedy answers directly (0% val accuracy) while
    # about 1 sample in 5 calls the tool (tool_arith.py)
    "tool": dict(data="tool_arith", data_args=("--n-sft", "4000"), sft_config="configs/demo_tool_sft.yaml",
                 rl_config="configs/demo_tool.yaml", sft_noise=0.75, out="outputs/demo_tool"),
    # a tiny Qwen2.5-VL (verl_hpc/models/tiny_vlm.py) on pictures drawn with Pillow (prepare/visual.py);
    # 12,000 SFT rows seen 4 times: 2,000 seen 12 times were memorised, noisy labels and all (measured)
    "visual": dict(data="visual", data_args=("--kinds", "colour", "--n-sft", "12000"), sft_config="configs/demo_vlm_sft.yaml",
                   rl_config="configs/demo_vlm.yaml", sft_noise=0.7, out="outputs/demo_vlm",
                   model=("verl_hpc.models.tiny_vlm", "qwen2_5_vl")),
}
# make demo-judge: the arithmetic task, its RL rewarded only by a tiny judge trained here (demo_judge.py)
TASKS["judge"] = dict(TASKS["arith"], rl_config="configs/demo_judge.yaml", out="outputs/demo_judge", judge=True)
# make demo-agent: the arithmetic task, each sample a run of an openai-client agent (demo_agent_solver.py)
TASKS["agent"] = dict(TASKS["arith"], rl_config="configs/demo_agent.yaml", out="outputs/demo_agent", agent=True)
GRID_SAMPLES = 12  # validation pictures in the visual demo's before/after grid


def sh(cmd, what: str) -> None:
    print(f"\n=== {what}: {' '.join(cmd)}", flush=True)
    t = time.time()
    rc = subprocess.call(cmd)
    if rc != 0:
        sys.exit(f"demo: '{what}' failed with exit code {rc}")
    print(f"=== {what}: done in {time.time() - t:.0f}s", flush=True)


def planned_host_gib(config: str, overrides) -> float:
    """The memory plan's peak host bytes per rank of the RL phase (a CPU job: the node's host
    figure over its ranks), for the demo to print next to the measured peak."""
    from verl_hpc.config import load_config
    from verl_hpc.planning import plan_job

    plan = plan_job(load_config(config, list(overrides)))
    groups = getattr(plan, "groups", None)  # split placement: one plan per group
    plans = list(groups.values()) if groups else [plan]
    return max(p.host_peak / max(p.ranks_per_node, 1) for p in plans) / 2**30


def steps_to_best(history, metric: str = "val/acc/all"):
    """(the best value of `metric` over the run, the first step that reached it); None without it."""
    points = [(r["step"], r[metric]) for r in history if isinstance(r.get(metric), (int, float))]
    if not points:
        return None
    best = max(v for _, v in points)
    return best, min(s for s, v in points if v == best)


def mismatch(history):
    """(mean over steps of rollout/logprob_diff_mean, its largest step value, the mean router
    agreement or None): a run's rollout/training gap (make demo-moe: with and without replay). The
    agreement is the old-log-prob forward's (moe/route_agreement) or, with the on-policy shortcut,
    the update's (actor/moe/route_agreement)."""
    pick = lambda key: [r[key] for r in history if isinstance(r.get(key), (int, float))]  # noqa: E731
    means = pick("rollout/logprob_diff_mean")
    agree = pick("moe/route_agreement") or pick("actor/moe/route_agreement")
    if not means:
        return None
    return sum(means) / len(means), max(means), (sum(agree) / len(agree) if agree else None)


def compare(out: Path, runs) -> None:
    """Both runs' validation curves in one plot, and each one's best accuracy and when it got there."""
    from verl_hpc.tracking import read_history
    from verl_hpc.tracking.plots import write_comparison

    histories = {label: read_history(folder / "metrics.jsonl") for label, folder in runs.items()}
    labels = list(histories)
    path = write_comparison(histories, "val/acc/all", out / f"compare_{labels[0]}_vs_{labels[1]}.png",
                            title="greedy validation accuracy, same seeds and steps", ylabel="accuracy")
    kl = "rollout_corr/kl_k3"  # a quantized rollout's mismatch (make demo-fp8): its curve per step
    if any(kl in r for h in histories.values() for r in h):
        kl_path = write_comparison(histories, kl, out / f"compare_{labels[0]}_vs_{labels[1]}_kl.png", ylim=None,
                                   title="rollout/training mismatch KL (k3) per step", ylabel="KL(pi_rollout || pi_old)")
        print(f"mismatch plot: {kl_path}")
    for label, history in histories.items():
        best = steps_to_best(history)
        if best:
            print(f"  {label}: best {100 * best[0]:5.1f}% first at step {best[1]}")
        gap = mismatch(history)
        kls = [r[kl] for r in history if isinstance(r.get(kl), (int, float))]
        if kls:
            print(f"  {label}: mismatch KL (k3) {sum(kls) / len(kls):.2e} mean over {len(kls)} steps, first 10 "
                  f"{sum(kls[:10]) / len(kls[:10]):.2e}, last 10 {sum(kls[-10:]) / len(kls[-10:]):.2e}")
        if gap:
            print(f"  {label}: rollout vs training log-prob |diff| per token {gap[0]:.2e} (mean over steps; "
                  f"worst step {gap[1]:.2e})"
                  + (f"; router agreement {100 * gap[2]:.3f}%" if gap[2] is not None else ""))
    print(f"comparison plot: {path}")


def answer_grid(out: Path, rl_out: Path, steps: int) -> Path:
    """The visual demo's picture: the first validation images with the greedy answers of the warm
    start and of the RL run's last checkpoint (exported to a HF folder), green where right."""
    from verl_hpc.rewards import default_score
    from verl_hpc.trainer.programs.greedy_eval import greedy_answers
    from verl_hpc.tracking.image_grid import answer_lines, write_image_grid

    import pyarrow.parquet as pq

    val = out / "data" / "val_grid.parquet"
    pq.write_table(pq.read_table(out / "data" / "val.parquet").slice(0, GRID_SAMPLES), val)
    after = out / "rl_hf"
    sh([sys.executable, "-m", "verl_hpc.checkpoint", "export", str(rl_out / "checkpoints" / f"step_{steps:06d}"),
        "--hf", str(after), "--overwrite"], "export the RL policy")
    runs = {label: greedy_answers(str(folder), str(val), 8, "prompt", True)
            for label, folder in (("before RL", out / "sft" / "hf"), ("after RL", after))}
    images, captions = [], []
    for k, (row, _) in enumerate(runs["before RL"]):
        truth = str(row["ground_truth"])
        answers = {label: (got[k][1].strip(), default_score(row["data_source"], got[k][1], truth) > 0)
                   for label, got in runs.items()}
        images.append(row["images"][0])
        captions.append(answer_lines(row["prompt"].replace("<image>", ""), truth, answers))
    return write_image_grid(out / "val_answers.png", images, captions, columns=6,
                            title="validation pictures: greedy answers before and after RL").path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="arith", choices=tuple(TASKS))
    ap.add_argument("--out", default=None, help="default: outputs/demo (arith), outputs/demo_tool (tool)")
    ap.add_argument("--ranks", type=int, default=None, help="local ranks for SFT and RL (default: each config's)")
    ap.add_argument("--rl-config", default=None,
                    help="the RL phase's config (default: the task's; configs/demo_rl_split.yaml: split placement, async)")
    ap.add_argument("--sft-noise", type=float, default=None, help="default: the task's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", default="llama", help="the tiny model's family (python -m verl_hpc.models.tiny "
                    "--help), e.g. qwen3_moe for the mixture-of-experts demo (make demo-moe)")
    ap.add_argument("--min-rise", type=float, default=30.0, help="accuracy points the RL phase must add")
    ap.add_argument("--compare", default=None, metavar="C",
                    help="a second RL config run from the same warm start; both validation curves in one plot")
    ap.add_argument("--rl-steps", type=int, default=None,
                    help="RL steps (trainer.total_steps of the RL phase only; default: the RL config's)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for both phases, e.g. parallel.tp=2")
    a = ap.parse_args(argv)
    task = TASKS[a.task]
    a.out, a.rl_config = a.out or task["out"], a.rl_config or task["rl_config"]
    a.sft_noise = task["sft_noise"] if a.sft_noise is None else a.sft_noise
    # the arguments the later phases would refuse only after the model and the data are made
    if a.ranks is not None and a.ranks < 1:
        ap.error(f"--ranks: got {a.ranks}; valid: a number of local ranks >= 1")
    if not 0.0 <= a.sft_noise <= 1.0:
        ap.error(f"--sft-noise: got {a.sft_noise}; valid: a fraction in [0, 1]")
    for option, config in (("--rl-config", a.rl_config), ("--compare", a.compare)):
        if config is not None and not Path(config).is_file():
            ap.error(f"{option}: no such config file '{config}'")
    out, py, t0 = Path(a.out), sys.executable, time.time()
    phase_dir = lambda config: out / ("rl" if a.task == "tool" else Path(config).stem.replace("demo_", ""))  # noqa: E731
    rl_out = phase_dir(a.rl_config)  # outputs/demo/rl, .../rl_split
    for phase in (out / "sft", rl_out, *([phase_dir(a.compare)] if a.compare else [])):
        shutil.rmtree(phase, ignore_errors=True)  # a rerun starts over (no resume from the last run's checkpoints)
    common = [*([f"slurm.tasks_per_node={a.ranks}"] if a.ranks else []), f"data.train_files=[{out}/data/train.parquet]",
              f"data.val_files=[{out}/data/val.parquet]"]
    maker, family = task.get("model", ("verl_hpc.models.tiny", a.family))
    sh([py, "-m", maker, str(out / "model"), "--family", family, "--layers", "2",
        "--seed", str(a.seed)], "tiny model")
    sh([py, "-m", "verl_hpc.data.prepare", task["data"], str(out / "data"), "--n-train", "2000",
        "--n-val", "100", "--seed", str(a.seed), "--sft-noise", str(a.sft_noise), *task["data_args"]],
       f"{task['data']} data")
    sh([py, "-m", "verl_hpc.submit", task["sft_config"], "--local", *common,
        f"model.path={out}/model", f"data.sft_files=[{out}/data/sft.parquet]",
        f"trainer.output_dir={out}/sft", f"trainer.hf_output_dir={out}/sft/hf", *a.overrides], "SFT warm start")
    judged = []
    if task.get("judge"):  # the judge: its own data and SFT, then measured on held-out answers
        from verl_hpc.trainer.programs.demo_judge import train_judge

        judge_acc = train_judge(out, seed=a.seed)
        print(f"judge accuracy on 500 held-out answers: {100 * judge_acc:.1f}%")
        judged = [f"reward.reward_model.path={out}/judge_sft/hf"]
    rl = lambda config: [py, "-m", "verl_hpc.submit", config, "--local", *common,  # noqa: E731
                         f"model.path={out}/sft/hf", f"trainer.output_dir={phase_dir(config)}", *judged,
                         *([f"trainer.total_steps={a.rl_steps}"] if a.rl_steps else []), *a.overrides]
    sh(rl(a.rl_config), f"RL ({Path(a.rl_config).stem})")
    if a.compare:
        sh(rl(a.compare), f"RL ({Path(a.compare).stem})")
    summary = json.loads((rl_out / "rl_summary.json").read_text())
    before = 100 * summary["val_before"]["val/acc/all"]
    after = 100 * summary["val_after"]["val/acc/all"]
    print("\n" + "=" * 72)
    print(f"validation accuracy (greedy, {out}/data/val.parquet):")
    print(f"  after SFT warm start (before RL): {before:5.1f}%")
    print(f"  after {summary['steps']} RL steps ({Path(a.rl_config).stem}): {after:5.1f}%   ({after - before:+.1f} points)")
    if task.get("judge"):
        rows = [json.loads(line) for line in (rl_out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        agree = [r["judge/agreement"] for r in rows if "judge/agreement" in r]
        if agree:
            print(f"judge/agreement with the rule during RL: {100 * agree[0]:.0f}% (step 1) -> "
                  f"{100 * agree[-1]:.0f}% (last step); judge accuracy held out {100 * judge_acc:.1f}%")
    if task.get("agent"):
        rows = [json.loads(line) for line in (rl_out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        runs = [r for r in rows if "agent/runs" in r]
        merges, splits = (sum(r[k] for r in runs) for k in ("agent/merges", "agent/splits"))
        print(f"agent runs: {sum(r['agent/runs'] for r in runs):.0f}, model calls {sum(r['agent/calls'] for r in runs):.0f}, "
              f"merged {merges:.0f}, split {splits:.0f}, failed {sum(r['agent/failures'] for r in runs):.0f}; "
              f"training reward {runs[0]['agent/reward_mean']:.2f} (step 1) -> {runs[-1]['agent/reward_mean']:.2f}")
    if a.task == "tool":
        rate = lambda v: 100 * v.get("val/episode/tool_call_rate", 0.0)  # noqa: E731
        print(f"greedy tool-call rate: {rate(summary['val_before']):5.1f}% -> {rate(summary['val_after']):5.1f}%")
    if a.compare:
        compare(out, {Path(c).stem: phase_dir(c) for c in (a.rl_config, a.compare)})
    if a.task == "visual":
        print(f"image grid: {answer_grid(out, rl_out, summary['steps'])}")
    measured = summary.get("host_peak_gib_per_rank") or []
    if measured:
        planned = planned_host_gib(a.rl_config, [*common, f"model.path={out}/sft/hf", *judged, *a.overrides])
        print(f"peak host memory per rank: {max(measured):.2f} GiB measured, {planned:.2f} GiB planned "
              f"(python -m verl_hpc.plan {a.rl_config})")
    print(f"plot:    {summary.get('plot')}")
    print(f"metrics: {summary.get('metrics_file')}")
    print(f"wall time: {time.time() - t0:.0f}s")
    print("=" * 72)
    return 0 if after - before >= a.min_rise else 1


if __name__ == "__main__":
    sys.exit(main())
