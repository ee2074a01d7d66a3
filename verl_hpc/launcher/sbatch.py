"""A standalone sbatch script rendered from slurm/templates/, for users who submit by hand."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import jinja2

from verl_hpc.launcher import charliecloud
from verl_hpc.launcher.plan import Plan

TEMPLATES = Path(__file__).resolve().parents[2] / "slurm" / "templates"


def render(plan: Plan, cfg, config_path: Path, log_dir: Path, *, config_source: str,
           script_name: str) -> str:
    """`log_dir` must exist before sbatch runs: Slurm does not create --output directories."""
    if not (TEMPLATES / "job.sbatch.j2").exists():
        raise FileNotFoundError(f"sbatch template not found at {TEMPLATES / 'job.sbatch.j2'}: "
                                "--sbatch-script needs a source checkout of verl_hpc")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["quote"] = lambda v: shlex.quote(str(v))
    c = cfg.slurm.container
    python = "python" if c.runtime != "none" else sys.executable
    charlie = {}
    if c.runtime == "charliecloud":  # the prefix and set-up lines the Python submitter uses
        charlie = dict(prefix=shlex.join(charliecloud.run_prefix(c, os.getcwd())),
                       setup=charliecloud.setup_lines(c, os.getcwd()))
    return env.get_template("job.sbatch.j2").render(
        plan=plan, s=cfg.slurm, env=sorted(plan.env.items()), python=python, charlie=charlie,
        config_path=str(config_path), log_dir=str(log_dir),
        config_source=config_source, script_name=script_name)
