"""Run observability: console, JSONL, TensorBoard, W&B, MLflow, Prometheus; timers; plots.

    tracker = Tracker(cfg.tracking.backends, cfg.trainer.output_dir, cfg.trainer.total_steps,
                      cfg.trainer.project_name, cfg.trainer.experiment_name, config_dict,
                      is_main=ctx.rank == 0, log_every=cfg.tracking.log_every,
                      prometheus_port=cfg.tracking.prometheus_port, start_step=first_step)
    timer = StageTimer()
    for step in ...:
        with timer("generate"): ...
        metrics |= timer.pop()
        tracker.log(metrics, step)
    tracker.close()   # plots -> <output_dir>/plots/training_curves.png
"""
from verl_hpc.tracking.jsonl import read_history, truncate_from
from verl_hpc.tracking.plots import write_plots
from verl_hpc.tracking.timers import STAGES, StageTimer, throughput
from verl_hpc.tracking.tracker import BACKENDS, Tracker, missing_packages

__all__ = ["Tracker", "StageTimer", "throughput", "STAGES", "BACKENDS", "missing_packages",
           "read_history", "truncate_from", "write_plots"]
