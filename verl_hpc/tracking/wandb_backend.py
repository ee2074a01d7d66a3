"""Weights & Biases in offline mode: compute nodes usually have no internet.

The run lands in `<output_dir>/wandb/offline-run-*`; `wandb sync <that folder>` from a login node
uploads it. WANDB_MODE=online in the job's environment opts back into live logging.
`<prefix>/hist/<int>` bucket counts (histograms.py) go in as one `wandb.Histogram` named
`<prefix>/hist`, built from the counts (np_histogram) since there are no samples to re-bin.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from verl_hpc.tracking.histograms import hist_key, split_histograms

MAX_BINS = 512  # wandb.Histogram refuses more


class WandbBackend:
    def __init__(self, output_dir: str | os.PathLike, project: str, experiment: str,
                 config: Mapping[str, Any] | None = None, mode: str | None = None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("tracking.backends has 'wandb' but the wandb package is not "
                              "installed; `pip install wandb` or remove it from the list") from e
        self._wandb = wandb
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mode = mode or os.environ.get("WANDB_MODE") or "offline"
        self._run = wandb.init(project=project, name=experiment, dir=str(self.dir),
                               config=dict(config or {}), mode=self.mode)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        data: dict[str, Any] = dict(metrics)
        for h in split_histograms(metrics)[1]:
            if len(h.counts) > MAX_BINS:  # too wide for W&B: its bucket scalars stay as they are
                continue
            for b in h.buckets:
                data.pop(hist_key(h.prefix, b), None)
            data[h.name] = self._wandb.Histogram(np_histogram=(list(h.counts), h.edges()))
        self._run.log(data, step=step)

    def log_artifact(self, path: str | os.PathLike) -> None:
        # base_path keeps the file's name relative to the run dir instead of its absolute path
        self._run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def close(self) -> None:
        self._run.finish()
