"""The architecture matrix: every held-out architecture of tests/arch_matrix.py (and, with --tiny, the
families of verl_hpc.models.tiny) through what a user does with a model folder, each cell OK, CLEAR
(refused before the queue in one line, quoted) or FAIL (the error):

    vLLM        the support verdict before the queue (rollout/vllm/support.py, which asks vLLM itself)
    HF job      3 GRPO steps on the FSDP engine, rollout.engine=hf, one rank; OK where every step's
                rollout log-probs equal the update's forward within GAP_TOL (mean over the tokens)
    vLLM job    the same with rollout.engine=vllm through `submit --local`: OK where the verdict says
                vLLM serves the folder, else it must end in the submitter with the verdict's one line
    2 ranks     3 steps at 2 ranks through `submit --local` (HF rollout)
    export      `checkpoint export --hf` of the 2-rank job's last checkpoint, loaded in transformers:
                its logits against the FSDP engine resumed from that checkpoint (1e-5, fp32)

    python tests/arch_matrix_run.py OUT [--archs gpt2,bloom] [--tiny] [--md OUT/matrix.md]

A script, not a test: it runs about 4 jobs per architecture (20-40 min on 2 cores), far over the
suite's budget; the suite keeps a slice of it (tests/jobs/test_heldout_archs.py). It lives beside
the tests because it is built from their helpers (the tiny assets, the job runners, the engine
states) and their folders, not from anything a user installs.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from arch_matrix import HELD_OUT, make_arch  # noqa: E402
from jobs import MOVING, make_assets, metrics, run_here, run_job, small  # noqa: E402

TIED = ("gpt2", "bloom", "gemma2", "cohere2", "falcon")  # as the suite's jobs build them
STEPS = 3
EXPORT_TOL = 1e-5
GAP_TOL = 1e-4  # the mean |rollout - update| log-prob of a step; fp32 rollouts of the same weights: ~1e-7
IDS = [[5, 60, 61, 70, 9, 200, 201, 33, 34, 35, 36, 400], list(range(100, 112))]
COLUMNS = ("vLLM", "HF job", "vLLM job", "2 ranks", "export")


def job_args(assets: Path, model: Path, *extra):
    """3 small GRPO steps of the FSDP engine on `model` (the suite's held-out jobs' settings)."""
    return small(assets, f"model.path={model}", "parallel.engine=fsdp", f"trainer.total_steps={STEPS}",
                 "data.train_batch_size=2", "rollout.n=2", "tracking.backends=[jsonl]", "tracking.plots=false",
                 "slurm.cpus_per_task=1", *MOVING, *extra)


def error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1][:400]


def job_verdict(proc, summary, out: Path) -> tuple:
    if proc.returncode == 0 and summary and summary.get("steps") == STEPS:
        gaps = [r["rollout/logprob_diff_mean"] for r in metrics(out) if "rollout/logprob_diff_mean" in r]
        if not gaps:
            return "FAIL", "no rollout/logprob_diff_mean in metrics.jsonl"
        if max(gaps) > GAP_TOL:  # exit 0, but the rollout sampled from another model than the trained one
            return "FAIL", f"{STEPS} steps, but rollout vs update log-probs {', '.join(f'{g:.1e}' for g in gaps)}"
        return "OK", f"{STEPS} steps; rollout vs update log-probs <= {max(gaps):.1e}"
    text = proc.stdout + proc.stderr + "".join(f.read_text(errors="replace") for f in out.glob("logs/**/*.log"))
    return "FAIL", f"exit {proc.returncode}: {error_line(text)}"


# ------------------------------------------------------------------------------ the cells
def cell_vllm_verdict(model: Path):
    from verl_hpc.rollout.vllm.support import why_not_vllm

    why = why_not_vllm(str(model), split=False)
    return ("OK", "vLLM serves it") if why is None else ("CLEAR", why)


def cell_hf_job(assets: Path, model: Path, out: Path):
    proc, summary = run_here("configs/demo_rl.yaml", out, *job_args(assets, model, "rollout.engine=hf"))
    return job_verdict(proc, summary, out)


def cell_vllm_job(assets: Path, model: Path, out: Path, serves: bool):
    proc, summary = run_job("configs/demo_rl.yaml", out, *job_args(assets, model, "rollout.engine=vllm"), timeout=900)
    if serves:
        return job_verdict(proc, summary, out)
    text = proc.stdout + proc.stderr
    started = (out / "metrics.jsonl").exists() or any(out.glob("logs/**/*.log"))
    if proc.returncode != 0 and not started and "Traceback" not in text and "cannot serve" in text:
        return "CLEAR", error_line(text)
    return "FAIL", f"exit {proc.returncode}, a rank started: {started}: {error_line(text)}"


def cell_two_ranks(assets: Path, model: Path, out: Path):
    proc, summary = run_job("configs/demo_rl.yaml", out, *job_args(assets, model, "rollout.engine=hf"),
                            ranks=2, timeout=900)
    return job_verdict(proc, summary, out)


def cell_export(model: Path, out: Path, work: Path):
    from engine_states import export_gap

    latest = sorted((out / "checkpoints").glob("step_*"))
    if not latest:
        return "FAIL", f"no checkpoint under {out / 'checkpoints'}"
    gap, moved = export_gap(model, latest[-1], work, IDS)
    text = f"max |export - engine| logits {gap:.1e} ({latest[-1].name}; {moved:.1e} from the start)"
    return ("OK" if gap <= EXPORT_TOL and moved > EXPORT_TOL else "FAIL"), text


def guarded(fn, *args):
    """A cell's verdict; a traceback in the script itself is the cell's FAIL, not the matrix's end."""
    start = time.perf_counter()
    try:
        verdict, text = fn(*args)
    except Exception as e:  # noqa: BLE001 - every cell gets a verdict
        traceback.print_exc()
        verdict, text = "FAIL", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    return verdict, text, round(time.perf_counter() - start, 1)


def run_arch(arch: str, assets: Path, root: Path) -> dict:
    work = root / arch
    model = make_arch(work / "model", arch, dropout=0.1, tied=arch in TIED)
    row = {"arch": arch}
    row["vLLM"] = guarded(cell_vllm_verdict, model)
    row["HF job"] = guarded(cell_hf_job, assets, model, work / "hf_job")
    row["vLLM job"] = guarded(cell_vllm_job, assets, model, work / "vllm_job", row["vLLM"][0] == "OK")
    row["2 ranks"] = guarded(cell_two_ranks, assets, model, work / "two_ranks")
    if row["2 ranks"][0] == "OK":
        row["export"] = guarded(cell_export, model, work / "two_ranks", work / "export")
    else:
        row["export"] = ("FAIL", "no 2-rank checkpoint to export", 0.0)
    return row


# ------------------------------------------------------------------------------ the table
def markdown(rows, command: str) -> str:
    head = "| architecture | " + " | ".join(COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS) + "\n"
    body = ""
    for r in rows:
        cells = []
        for c in COLUMNS:
            verdict, text, _ = r[c]
            text = re.sub(r" \('/[^']*'\)", "", text)  # the working folder's path says nothing in a table
            if c == "vLLM job" and verdict == "CLEAR" and " cannot serve " in text:  # the verdict's reason again
                text = text[:text.index(" cannot serve ")] + " cannot serve model.path ...` (the reason in column vLLM)"
                text = "`" + text
            shown = text if c in ("HF job", "vLLM job", "export") or verdict != "OK" else ""
            cells.append(f"{verdict}: {shown}".replace("|", "\\|") if shown else verdict)
        body += f"| {r['arch']} | " + " | ".join(cells) + " |\n"
    return f"{head}{body}\n(`{command}`)\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="working folder (models, jobs, the table)")
    p.add_argument("--archs", default="", help="comma-separated subset (default: all of HELD_OUT)")
    p.add_argument("--tiny", action="store_true", help="add the families of verl_hpc.models.tiny")
    p.add_argument("--md", type=Path, help="markdown table to write (default: OUT/matrix.md)")
    a = p.parse_args(argv)
    from verl_hpc.models.tiny import FAMILIES

    archs = [x for x in a.archs.split(",") if x] or list(HELD_OUT) + (list(FAMILIES) if a.tiny else [])
    assets = make_assets(a.out / "assets")  # the tiny task's data files (and a model the jobs do not use)
    rows = []
    for arch in archs:
        start = time.perf_counter()
        rows.append(run_arch(arch, assets, a.out))
        with open(a.out / "matrix.jsonl", "a") as f:  # what is done survives a stopped run
            f.write(json.dumps(rows[-1]) + "\n")
        print(f"{arch}: " + ", ".join(f"{c} {rows[-1][c][0]}" for c in COLUMNS)
              + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    command = "python tests/arch_matrix_run.py OUT" + (f" --archs {a.archs}" if a.archs else "") + (" --tiny" if a.tiny else "")
    table = markdown(rows, command)
    (a.md or a.out / "matrix.md").write_text(table)
    print(table)
    return 0 if all(r[c][0] != "FAIL" for r in rows for c in COLUMNS) else 1


if __name__ == "__main__":
    sys.exit(main())
