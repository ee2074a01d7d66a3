"""After a signal-driven checkpoint: requeue the Slurm job, or just stop (rule: docs/signals.md).

    requeue_after_signal(ctx, step=12, checkpoint_dir=root, allowed=cfg.slurm.requeue)  # collective; SystemExit if requeued

- the warning signal (SIGUSR2, `--signal=USR2@N`): requeue (the time limit is near);
- SIGTERM: requeue only if Slurm is preempting the job. SIGTERM also comes from `scancel` and from
  the time limit, and a cancelled job that requeues itself takes the nodes again after Slurm's
  hold. So rank 0 asks Slurm (`scontrol show job`): a job Slurm is preempting shows a
  `PreemptTime`; a cancelled one shows `JobState=CANCELLED`. Anything else (or no answer) is
  treated as "stop": a job that wrongly stays stopped costs a resubmit, one that wrongly comes back
  costs the nodes.

Why our own `scontrol requeue` rather than submitit's requeue handler: the runtime owns
USR2/SIGTERM (the step in flight must finish on every rank first; submitit's handler acts inside
the signal on rank 0 only), the same code serves plain `sbatch launch/*.sbatch` jobs, and the
requeued job needs nothing new from submitit: it runs the same pickled call with
`trainer.resume=auto`. SystemExit (not an exception) keeps submitit from writing a result file, so
the submitter keeps waiting through REQUEUED/PENDING until the resumed attempt finishes.
"""
from __future__ import annotations

import logging
import os
import subprocess
from typing import Dict, NamedTuple, Optional

from verl_hpc.runtime.signals import WARNING_SIGNAL

log = logging.getLogger(__name__)


class Decision(NamedTuple):
    requeue: bool
    why: str


def scontrol_show_job(job_id: str, timeout_s: float = 30) -> Dict[str, str]:
    """`scontrol show job -o JOB` as {key: value} ({} when Slurm does not answer)."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("requeue: cannot ask Slurm about job %s (%s)", job_id, e)
        return {}
    if proc.returncode != 0:
        log.warning("requeue: `scontrol show job %s` failed: %s", job_id, proc.stderr.strip())
        return {}
    return parse_show_job(proc.stdout)


def parse_show_job(text: str) -> Dict[str, str]:
    """key=value pairs of one `scontrol show job -o` line (values never hold spaces there, except
    the last fields such as Command, which we do not read)."""
    out: Dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def decide(signal_name: Optional[str], job_info: Dict[str, str], requeue_enabled: bool = True) -> Decision:
    """Whether a job stopped by `signal_name` should be requeued, given `scontrol show job`'s fields."""
    if not requeue_enabled:
        return Decision(False, "slurm.requeue=false")
    if signal_name == WARNING_SIGNAL.name:
        return Decision(True, f"{signal_name} is Slurm's warning signal (time limit near)")
    state = job_info.get("JobState", "")
    preempt_time = job_info.get("PreemptTime", "None")
    if state == "PREEMPTED" or preempt_time not in ("None", "Unknown", ""):
        return Decision(True, f"{signal_name} with Slurm preempting the job (JobState={state or '?'}, "
                              f"PreemptTime={preempt_time})")
    if not job_info:
        return Decision(False, f"{signal_name} and Slurm did not say the job is preempted")
    return Decision(False, f"{signal_name} without preemption (JobState={state or '?'}: scancel or "
                           "the time limit); a cancelled job stays ended")


def requeue_after_signal(ctx, *, step: int, checkpoint_dir, allowed: bool) -> None:
    """After the checkpoint of `step` (saved because of a signal): requeue per `decide` and leave
    with SystemExit on every rank, or log how to resume and return. allowed: slurm.requeue.
    Collective."""
    job_id = os.environ.get("SLURM_JOB_ID")
    signal_name = ctx.preemption.agreed_signal or ctx.preemption.signal_name
    error, decision = None, Decision(False, "not a Slurm job")
    if ctx.rank == 0:
        if job_id:
            info = {} if signal_name == WARNING_SIGNAL.name else scontrol_show_job(job_id)
            decision = decide(signal_name, info, bool(allowed))
        if not decision.requeue:
            log.warning("stopped by %s after step %d; not requeued (%s): run the same job again to resume "
                        "from %s (trainer.resume=auto)", signal_name, step, decision.why, checkpoint_dir)
        else:
            cmd = ["scontrol", "requeue", job_id]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                error = f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}"
                log.error("requeue: %s; the checkpoint of step %d is committed; resubmit to resume",
                          error, step)
            else:
                log.warning("requeue: job %s requeued after the checkpoint of step %d (%s); it resumes "
                            "from %s when Slurm starts it again", job_id, step, decision.why, checkpoint_dir)
    requeued = _broadcast_flag(ctx, decision.requeue and error is None)
    if requeued:
        raise SystemExit(0)  # not an Exception: submitit writes no result, the submitter waits on


def _broadcast_flag(ctx, value: bool) -> bool:
    """Rank 0's answer on every rank; also the barrier that keeps every rank until the requeue is
    in (srun --kill-on-bad-exit)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    from verl_hpc.runtime.device import collective_device

    t = torch.tensor([1 if value else 0], dtype=torch.int32, device=collective_device())
    dist.broadcast(t, src=0)
    return bool(t.item())
