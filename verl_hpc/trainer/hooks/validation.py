"""Validation on held-out prompts: greedy (rollout.val_temperature) responses, scored by the same
rules as training; accuracy (score >= reward.correct_at) and mean reward per data_source.

Rank 0 holds the val set and broadcasts each chunk; generate is collective, so every rank runs it.
Metrics: val/acc/<data_source>, val/reward/<data_source>, and val/acc/all, val/reward/all; with
data.tasks also val/task/<name>/acc and val/task/<name>/reward per task.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Dict

from verl_hpc.data import val_batches
from verl_hpc.data.tasks import task_of
from verl_hpc.rollout import RolloutResult, SamplingSpec
from verl_hpc.rollout.metrics import episode_metrics
from verl_hpc.runtime.objects import broadcast_object
from verl_hpc.trainer.stages.batching import assemble
from verl_hpc.trainer.hooks.base import CONTINUE
from verl_hpc.trainer.stages.scoring import agent_rows, given_rewards, score_batch


class Validator:
    def __init__(self, cfg, ctx, tokenizer, dataset):
        self.spec = SamplingSpec.validation_from_config(cfg.rollout)
        chunks = list(val_batches(dataset, cfg.data.val_batch_size)) if ctx.rank == 0 and dataset else None
        self.chunks = broadcast_object(chunks) or []
        self.tokenizer = tokenizer
        self.correct_at = cfg.reward.correct_at

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def run(self, generate, scorer, pad_id: int, reward_model=None) -> Dict[str, float]:
        """generate(PromptBatch, spec) -> RolloutResult: the run's rollout (Roles.generate)."""
        sums, hits, counts = defaultdict(float), defaultdict(float), defaultdict(int)
        task_keys, results = set(), []
        for prompts in self.chunks:
            result = generate(prompts, self.spec)
            results.append(result)
            batch = assemble(prompts, result, self.tokenizer, pad_id)
            scores = None if agent_rows(result) else score_batch(scorer, batch, reward_model)[0]
            scores = given_rewards(scores, result, {})  # agent runs: their own rewards
            for ds, extra, s in _per_sample(result, batch, scores.tolist()):
                task = task_of(extra)
                keys = (ds, "all") + ((f"task:{task}",) if task else ())
                task_keys.update(keys[2:])
                for key in keys:
                    sums[key] += s
                    hits[key] += float(s >= self.correct_at)
                    counts[key] += 1
        out = {}
        for key, n in counts.items():
            if key in task_keys:
                name = key[len("task:"):]
                out[f"val/task/{name}/acc"], out[f"val/task/{name}/reward"] = hits[key] / n, sums[key] / n
                continue
            out[f"val/acc/{key}"] = hits[key] / n
            out[f"val/reward/{key}"] = sums[key] / n
        if results and results[0].episodes is not None:  # multi_turn: tool use on the val set
            out.update(episode_metrics(RolloutResult.concat(results), prefix="val/episode"))
        return out


def _per_sample(result, batch, scores):
    """(data_source, extra, score) of each sample: an agent run whose calls split into several rows
    counts once (its first row; all of them hold its reward)."""
    rows = range(len(scores))
    if result.episodes is not None:
        rows = [r for r in rows if getattr(result.episodes[r], "agent", None) is None
                or result.episodes[r].agent.sample_first]
    return [(batch.data_sources[r], batch.extras[r], scores[r]) for r in rows]


class ValidationHook:
    """Validation every trainer.val_every steps and at the last one: its metrics join the step's
    (so the stop rule and task weights see them), summary["val_after"] keeps the latest, and its
    time is its own metric (timing_s/validation), left out of the next timing_s/step (and so of
    throughput and the ETA)."""
    stage = None  # names "validate" itself, on the steps it validates

    def __init__(self, validate: Callable[[int], Dict[str, float]], val_every: int):
        self.validate, self.val_every = validate, val_every

    def __call__(self, step, metrics, run):
        if run.last(step) or step % self.val_every == 0:
            run.watchdog.stage("validate")
            v0 = time.perf_counter()
            metrics.update(val := self.validate(step))
            run.summary["val_after"] = val
            metrics["timing_s/validation"] = time.perf_counter() - v0
            run.timer.exclude(metrics["timing_s/validation"])
        return CONTINUE
