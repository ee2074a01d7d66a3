"""The quantized demo's figures from its RL runs' folders: accuracy before and after, the mismatch KL
(mean, first and last 10 steps, largest step), kl_trend at the end and at its largest, the served
check's and the sync's seconds per step; and three plots (KL per step, kl_trend, validation
accuracy) of all runs in one panel each.

    python benchmarks/quantized_demo_report.py --out OUT \\
        "float32 rollout=outputs/demo/rl" "fp8_per_channel + TIS=outputs/demo/rl_fp8" \\
        "fp8_per_channel, no correction=outputs/demo/rl_fp8_off"

The runs are the commands of docs/quantization.md, "The demo" (the same SFT warm start and seeds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
KL, TREND, ACC = "rollout_corr/kl_k3", "rollout_corr/kl_trend", "val/acc/all"


def figures(folder: Path) -> dict:
    from verl_hpc.tracking import read_history

    rows = read_history(folder / "metrics.jsonl")
    summary = json.loads((folder / "rl_summary.json").read_text())
    pick = lambda key: [r[key] for r in rows if isinstance(r.get(key), (int, float))]  # noqa: E731
    kl, trend = pick(KL), pick(TREND)
    return {"acc_before": summary["val_before"][ACC], "acc_after": summary["val_after"][ACC],
            "acc_best": max(pick(ACC)), "steps": summary["steps"],
            "kl_mean": statistics.mean(kl), "kl_first10": statistics.mean(kl[:10]),
            "kl_last10": statistics.mean(kl[-10:]), "kl_max": max(kl),
            "trend_last": trend[-1] if trend else None, "trend_max": max(trend) if trend else None,
            "checks": len(pick("sync/served_seconds")),
            "check_s": statistics.median(pick("sync/served_seconds")),
            "sync_s": statistics.median(pick("sync/seconds")), "step_s": statistics.median(pick("timing_s/step"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=FOLDER of each RL run")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from verl_hpc.tracking import read_history
    from verl_hpc.tracking.plots import write_comparison

    runs = dict(r.split("=", 1) for r in a.runs)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = {label: figures(Path(folder)) for label, folder in runs.items()}
    for label, f in table.items():
        trend = f"kl_trend last {f['trend_last']:.2f}, max {f['trend_max']:.2f}" if f["trend_last"] else "no kl_trend"
        print(f"{label}: accuracy {100 * f['acc_before']:.0f}% -> {100 * f['acc_after']:.0f}% (best "
              f"{100 * f['acc_best']:.0f}%) in {f['steps']} steps; KL k3 mean {f['kl_mean']:.2e}, first 10 "
              f"{f['kl_first10']:.2e}, last 10 {f['kl_last10']:.2e}, max {f['kl_max']:.2e}; {trend}; served check "
              f"{f['checks']} times, {f['check_s']:.4f} s (sync {f['sync_s']:.4f} s, step {f['step_s']:.3f} s)")
    histories = {label: read_history(Path(folder) / "metrics.jsonl") for label, folder in runs.items()}
    plots = [write_comparison(histories, KL, out / "quantized_demo_kl.png", ylim=None, ylabel="KL(pi_rollout || pi_old)",
                              title="demo RL phase: rollout/training mismatch KL (k3) per step"),
             write_comparison({k: v for k, v in histories.items() if any(TREND in r for r in v)}, TREND,
                              out / "quantized_demo_trend.png", ylim=None, ylabel="kl_trend", hlines={"no drift": 1.0},
                              title="demo RL phase: mismatch KL, last 5 steps / first 5 (kl_trend)"),
             write_comparison(histories, ACC, out / "quantized_demo_acc.png", ylabel="accuracy",
                              title="demo RL phase: greedy validation accuracy (the rollout engine's)")]
    print("plots: " + ", ".join(map(str, plots)))
    (out / "quantized_demo.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
