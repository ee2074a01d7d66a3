"""A standalone sbatch script rendered from slurm/templates/, for users who submit by hand.

Its #SBATCH options, set-up lines and srun line come from launcher/job_script.py, as the Python
submitter's do, so `sbatch` of this script runs the job submitit would have submitted.
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import jinja2

from verl_hpc.config import ConfigError
from verl_hpc.launcher import job_script
from verl_hpc.launcher.plan import Plan

TEMPLATES = Path(__file__).resolve().parents[2] / "slurm" / "templates"
# A path written into the script: a control character would end its line (a new command), and
# sbatch reads a backslash in an #SBATCH value (the log folder's) as an escape.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_IN_DIRECTIVE = re.compile(r"[\x00-\x1f\x7f\\]")


def render(plan: Plan, cfg, config_path: Path, log_dir: Path, *, config_source: str,
           script_name: str) -> str:
    """`log_dir` must exist before sbatch runs: Slurm does not create --output directories."""
    if not (TEMPLATES / "job.sbatch.j2").exists():
        raise FileNotFoundError(f"sbatch template not found at {TEMPLATES / 'job.sbatch.j2'}: "
                                "--sbatch-script needs a source checkout of verl_hpc")
    _check_path("--sbatch-script", str(log_dir), _IN_DIRECTIVE)
    _check_path("--sbatch-script", script_name, _CONTROL)
    _check_path("the config path", config_source, _CONTROL)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    workdir = os.getcwd()
    logs = dict(output=f"{log_dir}/%j_batch.out", error=f"{log_dir}/%j_batch.err")
    srun = ["srun", *job_script.srun_args(cfg), "--unbuffered", f"--output={log_dir}/%j_%t.out",
            f"--error={log_dir}/%j_%t.err", *job_script.python_argv(plan, cfg, workdir),
            "-u", "-m", "verl_hpc.job", str(config_path)]
    return env.get_template("job.sbatch.j2").render(
        directives=_with_logs(job_script.allocation_directives(plan, cfg),
                              [job_script.directive(k, v) for k, v in logs.items()]),
        setup=job_script.setup_lines(plan, cfg, workdir),
        srun=shlex.join([*job_script.supervisor_argv(plan, cfg), *srun]),
        config_source=shlex.quote(config_source), script_name=shlex.quote(script_name))


def _with_logs(directives: list[str], logs: list[str]) -> list[str]:
    """The log options belong to the job as a whole: the first block (before a `hetjob` line)."""
    cut = directives.index(job_script.HETJOB) if job_script.HETJOB in directives else len(directives)
    return directives[:cut] + logs + directives[cut:]


def _check_path(what: str, path: str, unwritable: re.Pattern) -> None:
    m = unwritable.search(path)
    if m:
        raise ConfigError(f"{what}: {path!r} contains {m.group()!r}, which the sbatch script cannot "
                          "carry (a control character ends the line; sbatch reads '\\' as an escape); "
                          "valid: a path without them")
