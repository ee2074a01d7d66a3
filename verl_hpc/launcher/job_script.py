"""What a Slurm job of ours asks for and runs, whichever program writes its batch script.

Two writers make the script: submitit (the Python submitter, launcher/slurm.py) and the template
of `--sbatch-script` (launcher/sbatch.py). Both take the #SBATCH options, the set-up lines, the
srun arguments and the rank command from here, so the two scripts describe the same job
(tests/unit/test_bad_inputs_slurm.py compares them).

Every value that reaches a shell is quoted: submitit quotes #SBATCH values and srun arguments
itself (shlex.quote), the template does the same through `directive` and `shlex.join`, and the
rank command is a list of arguments, one per item of `slurm.container.extra_args` and `mounts`.
`slurm.setup` is the exception by design: it is the user's own shell code, written as it is.

Split placement needs nothing here beyond the allocation: every rank runs the same command in one
srun step and reads the placement from the config. A heterogeneous job (placement.rollout_partition)
is two #SBATCH blocks, the rollout nodes first (their ranks come first), and an srun that spans both;
only the template writes it (submitit has one block per job: launcher/slurm.py refuses it).
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from verl_hpc.launcher import charliecloud

# --kill-on-bad-exit: one rank exiting non-zero ends the step at once instead of leaving the
# others blocked in a collective until the time limit.
SRUN_ARGS = ["--mpi=pmix", "--kill-on-bad-exit=1"]
WARNING_SIGNAL = "USR2"  # submitit's SlurmJobEnvironment.USR_SIG: its handler and ours agree
HETJOB = "#SBATCH hetjob"  # sbatch's separator between the components of a heterogeneous job
# What one component's nodes are: sbatch resets partition, constraint and exclusive for every
# component and the task and GPU counts are per component; each block writes its own. The rest
# (job name, time, signal, requeue, account, qos, logs, slurm.additional) is written once, in the
# first block, and sbatch carries it over to the job as a whole.
COMPONENT_OPTIONS = ("partition", "nodes", "ntasks_per_node", "gpus_per_node", "cpus_per_task", "mem",
                     "constraint", "exclusive")
# the in-allocation restart's supervisor, run by its path on the batch host (docs/resilience.md)
RESTART_LOOP = str(Path(__file__).resolve().with_name("restart_loop.py"))


def sbatch_parameters(plan, cfg) -> dict:
    """The allocation as submitit.SlurmExecutor parameters (its names: `time` in minutes,
    `signal_delay_s`, `additional_parameters` for what it has no name for)."""
    s = cfg.slurm
    # restarts on: a node failure leaves the job running (--no-kill) for the supervisor to relaunch on
    # the nodes left, or requeue; the spare nodes come with the allocation
    restarts = {"no_kill": True} if s.max_restarts else {}
    params = dict(job_name=s.job_name, nodes=plan.nodes + s.spare_nodes, ntasks_per_node=plan.tasks_per_node,
                  cpus_per_task=s.cpus_per_task, time=s.time_min, signal_delay_s=s.signal_delay_s,
                  additional_parameters={**({"requeue": True} if s.requeue else {}), **restarts, **dict(s.additional)})
    if plan.gpus_per_node:
        params["gpus_per_node"] = plan.gpus_per_node
    params.update({key: getattr(s, key) for key in ("partition", "account", "qos", "constraint")
                   if getattr(s, key)})
    if s.mem_gb:
        params["mem"] = f"{s.mem_gb}GB"
    if s.exclusive:
        params["exclusive"] = True
    return params


def directives(params: dict) -> list[str]:
    """The #SBATCH lines submitit writes for `params` (sorted as it sorts them), without the ones
    it adds for its own bookkeeping (--output, --error, --open-mode, --wckey)."""
    flags = {k: v for k, v in params.items() if k not in ("signal_delay_s", "additional_parameters")}
    flags["signal"] = f"{WARNING_SIGNAL}@{params['signal_delay_s']}"
    flags.update(params["additional_parameters"])
    return [directive(k, flags[k]) for k in sorted(flags)]


def allocation_directives(plan, cfg) -> list[str]:
    """The allocation's #SBATCH lines: one block, or a heterogeneous job's two (component 0: the
    rollout nodes from placement.rollout_partition; component 1: slurm.nodes training nodes)."""
    params = sbatch_parameters(plan, cfg)
    if not plan.hetjob:
        return directives(params)
    training = {k: params[k] for k in COMPONENT_OPTIONS if k in params}
    # slurm.constraint names features of the training nodes; the rollout partition has its own
    rollout = {**{k: v for k, v in training.items() if k != "constraint"},
               "partition": plan.rollout_partition, "nodes": plan.rollout_nodes}
    job_wide = {k: v for k, v in params.items() if k not in COMPONENT_OPTIONS}
    return directives({**job_wide, **rollout}) + [HETJOB] + [directive(k, training[k]) for k in sorted(training)]


def directive(key: str, value) -> str:
    """submitit's rule: `_` -> `-`, True -> a bare flag, else a shell-quoted value, which sbatch's
    directive parser reads back unchanged (backslashes are refused in config/sbatch_text.py)."""
    key = key.replace("_", "-")
    return f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}"


def srun_args(cfg) -> list[str]:
    """srun's own arguments after the launch flags: pyxis runs the container through srun."""
    c = cfg.slurm.container
    # a heterogeneous job's srun starts on component 0 only unless told to span both (one step:
    # one world of ranks, the rollout nodes' first)
    launch = (["--het-group=0,1"] if cfg.placement.hetjob else []) + SRUN_ARGS
    if c.runtime != "pyxis":
        return launch
    mounts = ["--container-mounts=" + ",".join(c.mounts)] if c.mounts else []
    return [*launch, f"--container-image={c.image}", *c.extra_args, *mounts]


def supervisor_argv(plan, cfg) -> list[str]:
    """What runs srun for the batch script: the restart supervisor (launcher/restart_loop.py) with
    the job's settings and `--` before srun's line; [] with slurm.max_restarts = 0 (srun alone, a
    dead rank ends the job). It runs on the batch host, outside any container: the submitter's
    Python where the ranks run in it, else the host's python3. The heartbeat timeout and the
    checkpoint folder it learns from the ranks (launcher/heartbeat.py)."""
    s = cfg.slurm
    if not s.max_restarts:
        return []
    python = sys.executable if s.container.runtime == "none" else "python3"
    # the nodes a launch needs: a heterogeneous job's rollout nodes too (a lost one leaves too few:
    # the job is requeued, not relaunched on the training nodes alone)
    nodes = plan.nodes + (plan.rollout_nodes if plan.hetjob else 0)
    return [python, RESTART_LOOP, "--max-restarts", str(s.max_restarts), "--spare-nodes", str(s.spare_nodes),
            "--nodes", str(nodes), "--tasks-per-node", str(plan.tasks_per_node),
            "--backoff-s", f"{s.restart_backoff_s:g}", "--run-dir", str(plan.log_dir),
            *(["--requeue"] if s.requeue else []), "--"]


def python_argv(plan, cfg, workdir: str) -> list[str]:
    """The interpreter each rank runs, behind its container runtime's command."""
    c = cfg.slurm.container
    if c.runtime == "apptainer":
        binds = [arg for m in c.mounts for arg in ("--bind", m)]
        return ["apptainer", "exec", *(["--nv"] if plan.gpus_per_node else []), *binds, *c.extra_args,
                c.image, "python"]
    if c.runtime == "charliecloud":
        return charliecloud.run_prefix(c, workdir) + ["python"]
    if c.runtime == "pyxis":
        return ["python"]
    return [sys.executable]  # the submitter's venv is on the shared filesystem


def setup_lines(plan, cfg, workdir: str) -> list[str]:
    """Shell lines run once before srun: the job's environment, then slurm.setup as written."""
    c = cfg.slurm.container
    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(plan.env.items())] + list(cfg.slurm.setup)
    return lines + (charliecloud.setup_lines(c, workdir) if c.runtime == "charliecloud" else [])
