"""What every training program (rl, sft, dpo) does around its loop, in one place.

    check_tracking(cfg)                                   # before any collective work
    with tracked(cfg, ctx, summary, start_step=...) as tracker:
        ...the loop, tracker.log(metrics, step)...        # summary["steps"], summary["stopped"]
    finish(cfg, ctx, "rl", summary, requeue=checkpointer.requeue_if_preempted)

tracked: the run's Tracker (tracking.*), closed as the run ended: "failed" with the error's type
and message when it raised (Prometheus and tracking.alert_webhook hear why), else with
summary["stopped"] (a planned stop_at end counts as completed).
finish: every rank's peak host memory goes into the summary (`host_peak_gib_per_rank`, a collective);
rank 0 writes <output_dir>/<name>_summary.json and prints one `<NAME>_RESULT {json}` line
(the summary without its per-step history; launchers and tests parse it), then every rank calls
`requeue` (a preempted run is requeued per runtime/requeue.py: SystemExit on every rank).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional

from verl_hpc.config import ConfigError, to_container
from verl_hpc.tracking import Tracker, missing_packages


def check_tracking(cfg) -> None:
    """Refuse tracking.backends whose packages are missing (on every rank, before any collective):
    a ConfigError, so the job ends with one line naming the field and exit code 2."""
    missing = missing_packages(cfg.tracking.backends)
    if missing:
        raise ConfigError(f"tracking.backends needs packages that are not installed: {', '.join(missing)}")


@contextlib.contextmanager
def tracked(cfg, ctx, summary: Dict, *, start_step: Optional[int] = None,
            total_steps: Optional[int] = None) -> Iterator[Tracker]:
    """start_step: the first step this run logs (earlier rows of a resumed run's metrics file are
    kept, later ones dropped; None: the file is not checked); total_steps: default trainer.total_steps."""
    tracker = Tracker.from_config(cfg.tracking, cfg.trainer, job_name=cfg.slurm.job_name, is_main=ctx.rank == 0,
                                  start_step=start_step, total_steps=total_steps, config=to_container(cfg))
    try:
        yield tracker
    except BaseException as e:
        tracker.close("failed", summary.get("steps"), reason=f"{type(e).__name__}: {e}"[:500])
        raise
    finally:  # idempotent: after a failure this closes nothing again
        stopped = summary.get("stopped", "completed")
        tracker.close("completed" if stopped == "stop_at" else stopped, summary.get("steps"))


def host_peaks_gib() -> list:
    """Every rank's peak resident host memory in GiB, in rank order (a collective): the process's
    high-water mark, which the memory plan's host figure per rank bounds on a CPU job."""
    import resource

    import torch.distributed as dist

    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [round(mine, 3)]
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, round(mine, 3))
    return peaks


def finish(cfg, ctx, name: str, summary: Dict, requeue: Optional[Callable[[], None]] = None) -> Dict:
    summary["host_peak_gib_per_rank"] = host_peaks_gib()
    if ctx.rank == 0:
        out = Path(cfg.trainer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}_summary.json").write_text(json.dumps(summary, indent=1, default=str))
        shown = {k: v for k, v in summary.items() if k != "history"}
        print(f"{name.upper()}_RESULT {json.dumps(shown, default=str)}", flush=True)
    if requeue is not None:
        requeue()  # requeue (SystemExit on every rank) or stop
    return summary
