"""What every training program (rl, sft, dpo) does around its step, in one place: one loop.

    class SFT(StepProgram):
        name, fmt = "sft", "verl_hpc.sft_trainer/1"
        def step(self, step, timer): ...                  # one optimizer step -> metrics
    summary = SFT(cfg, ctx, ...).fit()                    # resume, the hooks, the tracker
    finish(cfg, ctx, "sft", summary, requeue=program.requeue)

A program says what a step does, what its checkpoint holds (`self.checkpointer`, built with
`make_checkpointer` from the named objects it has) and which hooks of its own run after a step
(`extra_hooks`: validation, task weights, rollback); `fit` does the rest the same way for all:
resume per `trainer.resume`, the stage watchdog, the step timer, `run_steps` with the program's
hooks followed by log, checkpoint, stop rule (`trainer.stop_at`) and preemption (Slurm's warning
signal or SIGTERM: save and stop; `requeue` then requeues per runtime/requeue.py).

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
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional

from verl_hpc.checkpoint.checkpointer import Checkpointer, CheckpointOptions
from verl_hpc.config import ConfigError, to_container, to_yaml
from verl_hpc.config.layout import Layout
from verl_hpc.runtime import collectives, faults, heartbeat, memory_peaks
from verl_hpc.runtime.device import synchronize
from verl_hpc.runtime.watchdog import StageWatchdog, WatchedTimer
from verl_hpc.tracking import StageTimer, Tracker, missing_packages, throughput
from verl_hpc.tracking.history import MetricHistory
from verl_hpc.trainer.hooks.base import CheckpointHook, LogHook, PreemptionHook, RunState, run_steps
from verl_hpc.trainer.hooks.stopping import StopHook, StopRule


# ------------------------------------------------------------------------------ shared pieces
def steps_from_epochs(rows: int, batch_size: int, epochs: int, total_steps: int) -> int:
    """Optimizer steps for `epochs` passes over `rows` at `batch_size` per step, capped by
    `total_steps` when that is > 0. Batches run on across epoch boundaries (the samplers never
    drop a row), so a pass is ceil(rows / batch_size) steps."""
    per_epoch = math.ceil(rows / batch_size)
    steps = per_epoch * int(epochs)
    return min(int(total_steps), steps) if total_steps > 0 else steps


def check_tracking(cfg) -> None:
    """Refuse tracking.backends whose packages are missing (on every rank, before any collective):
    a ConfigError, so the job ends with one line naming the field and exit code 2."""
    missing = missing_packages(cfg.tracking.backends)
    if missing:
        raise ConfigError(f"tracking.backends needs packages that are not installed: {', '.join(missing)}")


def make_checkpointer(cfg, ctx, *, engines: Mapping, states: Mapping, fmt: str, total_steps: int,
                      before_state=None, after_load=None) -> Checkpointer:
    """The checkpointer of a program, from the job's checkpoint and trainer sections."""
    c, tr, p = cfg.checkpoint, cfg.trainer, cfg.parallel
    options = CheckpointOptions(
        dir=c.dir, save_every=c.save_every, keep_last=c.keep_last, async_save=c.async_save,
        resume=str(tr.resume or "auto"), namespace=tr.namespace, total_steps=total_steps,
        timeout_s=tr.collective_timeout_s, program=tr.job,
        layout={"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": Layout(ctx.world_size, p.tp, p.pp, p.cp).dp})
    return Checkpointer(options, ctx, engines=engines, states=states, fmt=fmt, config_yaml=lambda: to_yaml(cfg),
                        history=MetricHistory(tr.output_dir), before_state=before_state, after_load=after_load)


def requeue_if_preempted(cfg, ctx, checkpointer: Checkpointer) -> None:
    """After a preemption stop: requeue the Slurm job (SystemExit on every rank) or log how to
    resume, per runtime/requeue.py's rule. Nothing when the run was not preempted. Collective."""
    if checkpointer.preempted_at is None:
        return
    from verl_hpc.runtime.requeue import requeue_after_signal

    requeue_after_signal(ctx, step=checkpointer.preempted_at, checkpoint_dir=checkpointer.root,
                         allowed=cfg.slurm.requeue)


def save_hf(engine, ctx, model_path: str, out_dir: str) -> None:
    """The engine's weights as a Hugging Face folder at `out_dir` (trainer.hf_output_dir), with
    `model_path`'s config, tokenizer and chat template. Collective: every rank joins the weight
    gather; rank 0 writes the folder. Under LoRA the weights are the base with the adapter merged
    in, and `adapter/` holds the adapter (PEFT)."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in engine.export_hf_weights()}
    adapter = ({name: t.detach().to("cpu").clone() for name, t in engine.export_adapter()}
               if getattr(engine, "lora", None) is not None else None)
    if ctx.rank != 0:
        return
    src, dst = Path(model_path), Path(out_dir)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():  # config, tokenizer, chat template: everything but the weights
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json")):
            shutil.copy2(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if adapter is not None:  # LoRA: the adapter itself too, as a PEFT folder (an RL run's lora.init_from)
        (dst / "adapter").mkdir()
        save_file(adapter, str(dst / "adapter" / "adapter_model.safetensors"), metadata={"format": "pt"})
        (dst / "adapter" / "adapter_config.json").write_text(json.dumps(engine.adapter_config(), indent=1))


# ------------------------------------------------------------------------------ the loop
class StepProgram:
    """A training program on the hook loop (module docstring). Subclasses set `name`, build
    `self.checkpointer` and `self.total_steps`, and define `step`."""

    name = "training"
    history_prefixes = None  # metrics kept in summary["history"] (None: all of them)
    headline = None  # a metric copied to the summary after every step (RL: the mean reward)

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.checkpointer: Optional[Checkpointer] = None
        self.total_steps = 0

    # what a program defines
    def step(self, step: int, timer) -> Dict[str, float]:
        raise NotImplementedError

    def extra_hooks(self) -> List:
        """The program's own hooks, run after each step before log, checkpoint, stop rule, preemption."""
        return []

    def begin(self, start: int, summary: Dict, tracker, watchdog) -> None:
        """After the resume, before the first step (e.g. a validation of the starting policy)."""

    def end(self, summary: Dict) -> None:
        """After the last step (and the checkpointer's close), still inside the tracked run."""

    def resume(self) -> int:
        return self.checkpointer.resume()

    def checked_step(self, step: int, timer) -> Dict[str, float]:
        """The step with whatever checks a program wraps around it (before its timings join)."""
        return self.step(step, timer)

    def timed_metrics(self, metrics: Dict[str, float]) -> None:
        """Metrics that need the step's time (timing_s/step is in `metrics`)."""

    # the loop
    def hooks(self, stop_rule: StopRule) -> List:
        ckpt = self.checkpointer
        return [*self.extra_hooks(), LogHook(self.history_prefixes, self.headline), CheckpointHook(ckpt),
                StopHook(stop_rule, ckpt, self.ctx.rank, self.name), PreemptionHook(ckpt)]

    def measured_step(self, step: int, timer) -> Dict[str, float]:
        """The step with its stage timings and throughput."""
        heartbeat.at_step(step)  # the step a restart's line names, where a supervisor watches
        metrics = self.checked_step(step, timer)
        # in-allocation restarts of this job before this launch (launcher/restarts.py)
        metrics["job/restarts"] = float(faults.attempt())
        metrics.update(timer.pop())
        metrics.update(throughput(metrics["timing_s/step"], tokens=metrics.get("train/tokens"),
                                  samples=metrics.get("train/samples"), world_size=self.ctx.world_size))
        self.timed_metrics(metrics)
        return metrics

    def fit(self, summary: Optional[Dict] = None) -> Dict:
        cfg, ctx, tr = self.cfg, self.ctx, self.cfg.trainer
        os.environ.setdefault("WANDB_MODE", cfg.tracking.wandb_mode)
        start = self.resume()
        summary = dict(steps=start, stopped="completed", **(summary or {}), resumed_from=start,
                       restarts=faults.attempt())  # in-allocation restarts before this launch
        summary.setdefault("total_steps", self.total_steps)  # "stopped at step 3 of 12" (launcher/local_stop.py)
        # resumed: keep the history up to `start`; fresh: none of an earlier run's
        with tracked(cfg, ctx, summary, start_step=start + 1 if start else 0, total_steps=self.total_steps) as tracker:
            # a rank stuck in its own code (not in a collective) fails the job naming itself and the stage
            dog = StageWatchdog(tr.stage_timeout_s, ctx.rank).start()
            stop_rule = StopRule.from_config(tr.stop_at, ctx)  # the wall-time budget counts from here
            try:
                self.begin(start, summary, tracker, dog)
                # comm_bytes: payload of every collective per stage (benchmarks/bench_scaling.py)
                timer = WatchedTimer(StageTimer(comm=collectives.counts if cfg.tracking.comm_bytes else None,
                                                sync=synchronize,
                                                memory=memory_peaks.probe() if cfg.tracking.stage_memory else None), dog)
                run = RunState(tracker, timer, dog, summary, self.total_steps, start=start)
                t0 = time.time()
                run_steps(lambda step: self.measured_step(step, timer), self.hooks(stop_rule), run)
                self.checkpointer.close()  # an async save in flight is committed before we report
                summary["seconds"] = round(time.time() - t0, 1)
                self.end(summary)
            finally:
                dog.stop()
        summary["plot"] = str(tracker.plot_path or "") or None
        summary["metrics_file"] = str(tracker.metrics_path) if tracker.metrics_path else None
        return summary

    def requeue(self) -> None:
        requeue_if_preempted(self.cfg, self.ctx, self.checkpointer)


# ------------------------------------------------------------------------------ around the loop
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
    import torch.distributed as dist

    mine = memory_peaks.process_peak_bytes() / 2**30
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
