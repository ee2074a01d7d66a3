"""Prompts -> responses -> scores -> (filtered) informative groups: the step's batch.

    sampler = StepSampler(cfg, ctx, roles, loader, scorer, sampling)
    batch, metrics = sampler.sample(step, timer)    # StepBatch with the rollout's and scoring's fields

With a group filter on -- algorithm.filter_groups (DAPO's dynamic sampling: groups whose rewards
differ) and/or algorithm.accuracy_filter (PRIME's: groups whose share of correct responses lies in
a band) -- rounds of train_batch_size prompts are generated until that many groups are kept (the
first train_batch_size of them are trained on) or algorithm.max_num_gen_batches rounds ran (then
the step trains on what it kept and says how many groups it missed). Reward and rollout metrics
describe the first round, unfiltered, as for every other recipe; filter/* the whole step.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from verl_hpc.algorithms import filter_groups, sequence_scores
from verl_hpc.algorithms.prime import accuracy_filter, outcome_labels
from verl_hpc.rollout.metrics import episode_metrics, rollout_metrics
from verl_hpc.trainer.stages.batching import assemble, broadcast_prompts
from verl_hpc.trainer.stages.rollout_dump import RolloutDump
from verl_hpc.rollout.agents.runner import untrained_rows
from verl_hpc.trainer.stages.scoring import add_turn_rewards, agent_rows, given_rewards, score_batch, to_token_level
from verl_hpc.trainer.stages.step_batch import StepBatch, concat_batches, first_groups
from verl_hpc.trainer.hooks.task_weights import task_metrics


def group_filters(batch, algorithm_cfg) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The keep mask of the step's group filters (all true when both are off) and their counts:
    DAPO's (algorithm.filter_groups: groups whose responses all scored the same carry no signal;
    reads batch.token_scores) and PRIME's (algorithm.accuracy_filter: groups whose share of correct
    responses lies outside [low, high]; reads batch.outcome_labels)."""
    a, keep, counts = algorithm_cfg, torch.ones(len(batch), dtype=torch.bool), {}
    if a.filter_groups:
        k, c = filter_groups(sequence_scores(batch.token_scores, batch.mask), batch.group_ids)
        keep, counts = keep & k, dict(counts, **c)
    if a.accuracy_filter.enable:
        f = a.accuracy_filter
        k, c = accuracy_filter(batch.outcome_labels, batch.group_ids, f.low, f.high)
        keep, counts = keep & k, dict(counts, **c)
    return keep, {f"filter/{k}": float(v) for k, v in counts.items()}


# the filter counts a step adds up over its generation rounds
_SUMMED = ("filter/dropped_groups", "filter/dropped_samples", "filter/acc_dropped_groups", "filter/acc_kept_groups")


class StepSampler:
    def __init__(self, cfg, ctx, roles, loader, scorer, sampling, source=None):
        """source(step, timer) -> (PromptBatch, RolloutResult, metrics): where a round's samples come
        from (split placement: the rollout group's stream); default: generate here, now."""
        self.cfg, self.ctx, self.roles = cfg, ctx, roles
        self.source = source or self._generate_here
        self.loader, self.scorer, self.sampling = loader, scorer, sampling
        self.dump = RolloutDump(cfg.trainer.rollout_data_dir, ctx.rank,
                                lambda ids: roles.tokenizer.decode(ids, skip_special_tokens=False))

    def _score(self, step: int, round_: int, batch) -> Tuple[torch.Tensor, Dict[str, float]]:
        """The round's sequence scores and its reward/* metrics (and GDPO's reward components)."""
        return score_batch(self.scorer, batch, self.roles.reward_model, components=self.cfg.algorithm.gdpo_reward_keys)

    def sample(self, step: int, timer) -> Tuple[StepBatch, Dict[str, float]]:
        cfg, r, m = self.cfg, self.roles, {}
        want = cfg.data.train_batch_size
        rounds = cfg.algorithm.max_num_gen_batches if cfg.algorithm.filters else 1
        parts, kept, dropped = [], 0, {}
        for round_ in range(rounds):
            prompts, result, m_source = self.source(step, round_, timer)
            if round_ == 0:
                m.update(m_source)
            batch = assemble(prompts, result, r.tokenizer, r.pad_id)
            with timer("reward"):
                # agent.enable: the runs' own rewards, no reward function run
                scores, m_reward = (None, {}) if agent_rows(result) else self._score(step, round_, batch)
                scores = given_rewards(scores, result, m_reward)
                batch.token_scores, m_shape = to_token_level(self.scorer, scores, batch, cfg)
                batch.outcome_labels = outcome_labels(scores, cfg.reward.correct_at)
                add_turn_rewards(batch.token_scores, result)  # multi_turn: per-turn terms
                keep, m_filter = group_filters(batch, cfg.algorithm)
                keep[untrained_rows(result)] = False  # agent runs without a model call: no token to train on
                batch.baselines = self._greedy_baselines(prompts, batch, step)  # ReMax only
            self.dump.write(step, round_, prompts, result, batch, scores)  # trainer.rollout_data_dir
            if round_ == 0:  # tokens/s, lengths, truncated prompts, finish reasons; rewards
                m.update(rollout_metrics(result), **episode_metrics(result), **m_reward, **m_shape)
                m.update(task_metrics(scores, batch.mask.sum(-1), batch.extras))  # data.tasks: per task
            for k in _SUMMED:
                if k in m_filter:
                    dropped[k] = dropped.get(k, 0.0) + m_filter[k]
            if not bool(keep.all()):
                batch = batch.select(keep)
            parts.append(batch)
            kept += len(set(batch.group_ids.tolist()))
            if kept >= want:
                break
        batch = concat_batches(parts, r.pad_id)
        if kept > want:  # a full batch, as every other step trains on
            batch = batch.select(first_groups(batch, want))
        if cfg.algorithm.accuracy_filter.enable:  # the share of generated groups outside the band
            acc = dropped.pop("filter/acc_dropped_groups"), dropped.pop("filter/acc_kept_groups")
            dropped["filter/acc_filtered_share"] = acc[0] / max(sum(acc), 1.0)
        if cfg.algorithm.filters:
            m.update(dropped, **{"filter/gen_batches": float(len(parts)),
                                 "filter/kept_groups": float(min(kept, want)),
                                 "filter/kept_samples": float(len(batch)),
                                 "filter/missing_groups": float(max(want - kept, 0))})
        return batch, m

    def _generate_here(self, step: int, round_: int, timer):
        prompts = broadcast_prompts(self.loader, self.ctx)
        with timer("generate"):
            return prompts, self.roles.generate(prompts, self.sampling.for_step(step, round_)), {}

    def _greedy_baselines(self, prompts, batch, step) -> Optional[torch.Tensor]:
        """ReMax: the reward of the greedy response to each prompt, per sequence of its group."""
        if self.cfg.algorithm.adv_estimator != "remax":
            return None
        spec = dataclasses.replace(self.sampling.for_step(step), n=1, temperature=0.0)
        result = self.roles.rollout.generate(prompts.prompt_ids, spec, media=prompts.media or None)
        self.roles.verify(result)
        greedy = assemble(prompts, result, self.roles.tokenizer, self.roles.pad_id)
        scores, _ = score_batch(self.scorer, greedy, self.roles.reward_model)
        return scores[batch.group_ids]
