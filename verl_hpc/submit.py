"""`python -m verl_hpc.submit CONFIG [dotted.overrides ...]`: validate, plan, run on Slurm or locally.

On a login node with Slurm it submits through submitit (one task per GPU, srun --mpi=pmix), waits
while streaming rank 0's log, and exits non-zero naming the failed rank's log when the job fails.
Where there is no Slurm, or with --local, it starts the ranks on this machine instead.

SIGTERM or Ctrl-C at any moment ends it with one line and 143 or 130 (docs/signals.md): from its
first line until the ranks start (imports, file checks) `[submit] stopped by SIGTERM before any
rank started; nothing was submitted` (launcher/early_signals.py); while local ranks run, the ranks
checkpoint and stop first (launcher/local_stop.py); a Slurm submission in flight completes first.
After a local job's result a signal changes nothing: `[submit] SIGTERM came after the job had
already finished OK: nothing left to stop`, and the result's exit code.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from verl_hpc.launcher import early_signals

if __name__ == "__main__":  # before the imports below, which take seconds on a loaded login node
    early_signals.install("submit", "before any rank started; nothing was submitted")

from verl_hpc.config import ConfigError, load_config, to_container, to_yaml, validate  # noqa: E402
from verl_hpc.errors import VerlHpcError  # noqa: E402
from verl_hpc.launcher.plan import RESOLVED_CONFIG, make_plan, write_resolved_config  # noqa: E402
from verl_hpc.launcher.startup_imports import without_gc  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verl_hpc.submit", description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="YAML job config (configs/*.yaml); omit for defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2")
    p.add_argument("--local", action="store_true", help="run the ranks on this machine")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and the sbatch script, submit nothing")
    p.add_argument("--print-config", action="store_true",
                   help="print the plan and the resolved config, then exit without submitting")
    p.add_argument("--no-wait", action="store_true", help="submit and return the job id")
    p.add_argument("--sbatch-script", metavar="PATH",
                   help="write a standalone sbatch script (and its resolved config) and stop")
    p.add_argument("--skip-model-check", action="store_true",
                   help="do not read model.path (plan a job for a model this machine cannot see)")
    p.add_argument("--ignore-memory-plan", action="store_true",
                   help="submit even when the memory plan (python -m verl_hpc.plan) says it does not fit")
    p.add_argument("--skip-file-checks", action="store_true",
                   help="do not check the data, model and output files here (they live elsewhere)")
    p.add_argument("--join", metavar="RUN_DIR",
                   help="elastic rollout workers for the running split run in RUN_DIR (its trainer.output_dir): "
                        "a Slurm job array of --workers tasks, or one worker here with --local; overrides set "
                        "the workers' allocation and engine (docs/elastic.md)")
    p.add_argument("--workers", type=int, default=1, help="--join: how many workers (array tasks)")
    args = p.parse_intermixed_args(argv)  # options may come after the overrides
    if args.config and "=" in args.config:  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def memory_check(cfg, args) -> int:
    """Print the memory plan's verdict; 2 (and one line on stderr) when the job would not fit."""
    if cfg.trainer.job == "smoke":  # no model, no engines
        return 0
    from verl_hpc.planning import plan_job, refusal, verdict
    from verl_hpc.plan import suggest_command

    try:
        mplan = plan_job(cfg)
    except ConfigError as err:  # the model's shape is not known here: say so, do not guess
        print(f"[submit] memory plan: skipped ({err})", flush=True)
        return 0
    print(f"[submit] {verdict(mplan)}", flush=True)
    if mplan.fits() or args.ignore_memory_plan:
        return 0
    print(f"error: {refusal(mplan, suggest_command(args.config, args.overrides))} "
          f"(or pass --ignore-memory-plan)", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.join:
        return _join(args)
    try:
        # the checks import torch (the data files) and transformers (the tokenizer): with the garbage
        # collector off, then the heap frozen, as a rank's start-up (launcher/startup_imports.py)
        with without_gc():
            from verl_hpc.launcher.preflight import preflight

            cfg = load_config(args.config, args.overrides)
            validate(cfg, check_model=not args.skip_model_check)
            if not args.skip_file_checks:  # the files it names: data, model weights, output folders
                preflight(cfg, check_model=not args.skip_model_check)
            plan = make_plan(cfg, local=args.local)
    except VerlHpcError as err:  # a ConfigError (2) for the config and the files it names
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(plan.describe(), flush=True)
    if memory_check(cfg, args) != 0:
        return 2
    if args.print_config:  # a look before the queue: nothing is submitted or started
        print(to_yaml(cfg), flush=True)
        return 0

    # Each path imports only its launcher: submitit (Slurm), torch's elastic launcher (--local) and
    # jinja2 (--sbatch-script) are heavy or optional, and the login node needs one of them.
    if args.sbatch_script:
        return write_sbatch_script(cfg, plan, args)

    if plan.backend == "local":
        from verl_hpc.launcher.local import rerun_command, run_local

        if args.dry_run:
            print(f"[submit] dry run: would start {plan.world_size} local rank(s) of "
                  "`python -m verl_hpc.job <resolved config>`")
            return 0
        return run_local(plan, write_resolved_config(cfg, plan.log_dir), checkpoint_dir=cfg.checkpoint.dir,
                         rerun=rerun_command(argv, cfg.trainer.resume))

    from verl_hpc import job as job_entry
    from verl_hpc.launcher import slurm

    try:
        executor = slurm.make_executor(plan, cfg)
    except ConfigError as err:  # a job submitit cannot submit (a heterogeneous one)
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("[submit] dry run: the sbatch script submitit would submit:\n")
        print(slurm.sbatch_text(executor))
        return 0
    with early_signals.held():  # sbatch cut half-way would leave it unknown whether a job exists
        job = slurm.submit(executor, job_entry.run, to_container(cfg))
        early_signals.where_now(f"after submitting job {job.job_id}, which goes on (scancel {job.job_id} stops it)")
    write_resolved_config(cfg, Path(str(plan.log_dir).replace("%j", str(job.job_id))))
    if args.no_wait:
        print(f"[submit] job {job.job_id} submitted; logs: {job.paths.folder}")
        return 0
    try:
        return slurm.wait(job, progress=_progress(cfg), rollout_ranks=plan.rollout_ranks)
    except KeyboardInterrupt:  # in-process use; run as a program, early_signals' line says this
        print(f"\n[submit] stopped waiting; job {job.job_id} goes on (scancel {job.job_id} stops it)",
              file=sys.stderr)
        return 130


def _join(args) -> int:
    from verl_hpc.launcher.join import join

    overrides = ([args.config] if args.config else []) + args.overrides
    if args.config and "=" not in args.config:
        print(f"error: --join takes the run's own config; {args.config} is not an override", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"error: --workers = {args.workers}: must be >= 1", file=sys.stderr)
        return 2
    try:
        return join(args.join, overrides, workers=args.workers, local=args.local)
    except VerlHpcError as err:  # cannot join (30), a bad override (2)
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


def write_sbatch_script(cfg, plan, args) -> int:
    from verl_hpc.launcher.sbatch import render

    script = Path(args.sbatch_script).absolute()
    config_path, logs = script.parent / RESOLVED_CONFIG, script.parent / "logs"
    try:  # rendered first: a path the script cannot carry leaves nothing behind
        text = render(plan, cfg, config_path, logs, config_source=args.config or "defaults",
                      script_name=script.name)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_resolved_config(cfg, script.parent)
    logs.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    print(f"[submit] wrote {script} and {config_path}; submit with: sbatch {shlex.quote(str(script))}")
    return 0


def _progress(cfg):
    """The step line for the status while the job runs (programs that write metrics.jsonl)."""
    from verl_hpc.launcher.slurm import MetricsProgress
    from verl_hpc.tracking.jsonl import FILENAME

    if cfg.trainer.job not in ("rl", "sft") or "jsonl" not in cfg.tracking.backends:
        return None
    return MetricsProgress(Path(cfg.trainer.output_dir) / FILENAME, cfg.trainer.total_steps)


if __name__ == "__main__":
    # not sys.exit: once the job's result is known a signal must find the handler that says so
    # until the process is gone, not Python's default, which its exit puts back (early_signals.end)
    early_signals.end(main())
