"""Weights & Biases in offline mode: compute nodes usually have no internet.

The run lands in `<output_dir>/wandb/offline-run-*`; `wandb sync <that folder>` from a login node
uploads it. WANDB_MODE=online in the job's environment opts back into live logging.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping


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
        self._run.log(dict(metrics), step=step)

    def log_artifact(self, path: str | os.PathLike) -> None:
        # base_path keeps the file's name relative to the run dir instead of its absolute path
        self._run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def close(self) -> None:
        self._run.finish()
