"""Run observability: console, JSONL, TensorBoard, W&B, MLflow, Prometheus; timers; plots.

    tracker = Tracker.from_config(cfg.tracking, cfg.trainer, job_name=cfg.slurm.job_name, is_main=ctx.rank == 0,
                                  start_step=first_step, config=config_dict)
    timer = StageTimer()
    for step in ...:
        with timer("generate"): ...
        metrics |= timer.pop()
        tracker.log(metrics, step)
    tracker.event("rollback", step, metric=...)   # counted in Prometheus, sent to tracking.alert_webhook
    tracker.close("completed", step)   # or failed / preempted; plots -> <output_dir>/plots/training_curves.png
    write_image_grid(path, images, captions)   # pictures with caption lines (answers green / red)
"""
from verl_hpc.tracking.image_grid import answer_lines, write_image_grid
from verl_hpc.tracking.jsonl import read_history, truncate_from
from verl_hpc.tracking.plots import write_plots
from verl_hpc.tracking.timers import STAGES, StageTimer, throughput
from verl_hpc.tracking.tracker import BACKENDS, Tracker, missing_packages

__all__ = ["Tracker", "StageTimer", "throughput", "STAGES", "BACKENDS", "missing_packages",
           "read_history", "truncate_from", "write_plots", "write_image_grid", "answer_lines"]
