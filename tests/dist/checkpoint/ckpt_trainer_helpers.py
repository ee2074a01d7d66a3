"""Shared set-up for the trainer-level checkpoint tests: a tiny model and the synthetic task
(tests/dist/trainer/trn_helpers.py), tiny GRPO runs, and reading a checkpoint's tensors whole."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from trn_helpers import REPO, data_overrides, logs, make_assets, metrics, run_job  # noqa: E402,F401

# GRPO on 1 rank with the HF rollout (seeded per step: a resumed run samples what the straight
# run sampled); a batch of 4 prompts x 4 samples keeps a step about a second on 2 cores.
TINY_GRPO = ["rollout.engine=hf", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
             "actor.micro_batch_size=8", "trainer.val_every=0", "tracking.backends=[jsonl]",
             "tracking.plots=false"]
# metrics that measure the machine, not the run
VOLATILE = ("timing_s/", "perf/", "throughput/", "time", "sync/seconds", "sync/gb_per_s",
            "sync/export_seconds", "sync/load_seconds", "rollout/seconds",
            "rollout/tokens_per_s")


def grpo(root: Path, out: Path, *extra, ranks: int = 1, timeout: int = 400):
    return run_job("configs/demo_rl.yaml", out, f"model.path={root}/model", *data_overrides(root),
                   *TINY_GRPO, *extra, ranks=ranks, timeout=timeout)


def stable_metrics(out: Path):
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in metrics(out)]


def read_all(ckpt) -> dict:
    """{name: full tensor} of every tensor of a checkpoint (root or directory)."""
    from verl_hpc.checkpoint import open_checkpoint

    with open_checkpoint(ckpt) as r:
        return {name: r.load_tensor(name) for name in r.tensors()}
