"""RewardScorer: one score per response, from rules, a custom function and/or a reward model.

    scorer = RewardScorer.from_config(cfg.reward, reward_model=None, allow_custom_code=cfg.safety.allow_custom_code)
    scorer.check_samples(ds.ids, ds.data_sources, ds.ground_truths)   # at load: unknown sources, bad answers
    scores, metrics = scorer.score(ids, data_sources, response_texts, ground_truths, extras)
    token_rewards = scorer.to_token_level(scores, response_mask)       # [B, T], score on the last token

A reward function that raises (any exception, and also a BaseException such as SystemExit or
KeyboardInterrupt raised by the function itself), does not return within reward.timeout_s
(per sample, enforced on a worker thread: rewards/timeout.py), or returns something that is not a
finite number within float32's range (a bool is refused: return 1.0/0.0; every number in a returned
dict must be finite too) follows reward.on_error: 'zero' scores the sample 0, counts it (metrics
'reward/errors', and the run total 'reward/errors_total') and logs the first traceback once (kept
in `first_error`); 'raise' stops with a RewardError naming the sample's id and data_source, the
original exception chained. An unknown data_source is a configuration problem, not a failing
function, and raises under both settings.
"""
from __future__ import annotations

import logging
import math
import numbers
import reprlib
import traceback
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_hpc.rewards import registry
from verl_hpc.rewards.custom import CustomFn, load_custom_function
from verl_hpc.rewards.errors import RewardError
from verl_hpc.rewards.gsm8k import METHODS as GSM8K_METHODS
from verl_hpc.rewards.reward_model import RewardModel, combine, normalize, rm_scores
from verl_hpc.rewards.timeout import FunctionExited, RewardTimeout, TimedCaller

log = logging.getLogger(__name__)
# what score() implements (reward.on_error, checked at load; a test keeps the choices the same names)
ON_ERROR = ("zero", "raise")
MAX_LISTED = 10
SCORE_MAX = float(torch.finfo(torch.float32).max)  # scores are float32 tensors


class RewardScorer:
    def __init__(self, on_error: str, custom_function: Optional[CustomFn] = None,
                 reward_model: Optional[RewardModel] = None, *, gsm8k_method: str,
                 timeout_s: float = 0.0, custom_name: str = "", rm_weight: float = 1.0,
                 rule_weight: float = 1.0, rm_normalize: str = "none"):
        if on_error not in ON_ERROR:
            raise RewardError(f"reward.on_error: invalid value {on_error!r}; valid: {', '.join(ON_ERROR)}")
        if gsm8k_method not in GSM8K_METHODS:
            raise RewardError(f"gsm8k_method: invalid value {gsm8k_method!r}; valid: {', '.join(GSM8K_METHODS)}")
        self.on_error, self.custom, self.reward_model = on_error, custom_function, reward_model
        self.gsm8k_method = gsm8k_method
        self.rm_weight, self.rule_weight, self.rm_normalize = rm_weight, rule_weight, rm_normalize
        self.call = TimedCaller(timeout_s)
        self.custom_name = custom_name or getattr(custom_function, "__qualname__", "custom")
        self.errors_total = 0
        self.first_error: Optional[str] = None  # "sample <id> (data_source <ds>):\n<traceback>"

    @classmethod
    def from_config(cls, reward_cfg, reward_model: Optional[RewardModel] = None, *,
                    allow_custom_code: bool) -> "RewardScorer":
        fn = None
        if reward_cfg.custom_function:  # allow_custom_code: the job's safety.allow_custom_code
            fn = load_custom_function(reward_cfg.custom_function, allow_custom_code)
        if reward_cfg.reward_model.enable and reward_model is None:
            raise RewardError("reward.reward_model.enable is true, but no reward model was passed to the scorer "
                              "(the engine's reward role builds it from reward.reward_model.path)")
        rm = reward_cfg.reward_model
        return cls(reward_cfg.on_error, fn, reward_model if rm.enable else None,
                   gsm8k_method=reward_cfg.gsm8k_method, timeout_s=reward_cfg.timeout_s,
                   custom_name=reward_cfg.custom_function, rm_weight=rm.weight, rule_weight=rm.rule_weight,
                   rm_normalize=rm.normalize)

    def rules_only(self) -> "RewardScorer":
        """This scorer without its reward model (reward.reward_model.validate = false: validation by
        the rules); the error count is its own."""
        return RewardScorer(self.on_error, self.custom, None, gsm8k_method=self.gsm8k_method,
                            timeout_s=self.call.timeout_s, custom_name=self.custom_name)

    # ------------------------------------------------------------------------------ routing
    def rule_for(self, data_source: str) -> Optional[registry.RuleScorer]:
        scorer = registry.resolve(data_source)
        if scorer is not None and scorer.name == "gsm8k" and self.gsm8k_method == "flexible":
            scorer = registry.get_scorer("gsm8k_flexible")
        return scorer

    def check_samples(self, ids: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[str]) -> None:
        """Refuse, before training starts, samples no rule can score or whose ground truth it rejects."""
        if self.custom is not None:
            return  # the user's function decides what it accepts
        problems: List[str] = []
        rules = {ds: self.rule_for(ds) for ds in set(data_sources)}
        for ds in sorted(ds for ds, rule in rules.items() if rule is None and self.reward_model is None):
            first = next(i for i, d in zip(ids, data_sources) if d == ds)
            problems.append(f"sample {first} (and every other with this source): {registry.unknown_source_message(ds)}")
        for sample_id, ds, truth in zip(ids, data_sources, ground_truths):
            rule = rules[ds]
            problem = rule.check(truth) if rule is not None and rule.check is not None else None
            if problem:
                problems.append(f"sample {sample_id} (data_source {ds!r}): field {problem}")
        if problems:
            shown = problems[:MAX_LISTED] + ([f"... and {len(problems) - MAX_LISTED} more"]
                                             if len(problems) > MAX_LISTED else [])
            raise RewardError(shown[0] if len(problems) == 1 else
                              "\n".join([f"{len(problems)} problems with rewards for the data:"] +
                                        [f"  - {p}" for p in shown]))

    # ------------------------------------------------------------------------------ scoring
    def score(self, ids: Sequence[str], data_sources: Sequence[str], response_texts: Sequence[str],
              ground_truths: Sequence[str], extras: Optional[Sequence[Mapping[str, Any]]] = None,
              rm_batch: Any = None) -> Tuple[torch.Tensor, Dict[str, float]]:
        scores, _, metrics = self.score_with_components(ids, data_sources, response_texts, ground_truths, extras,
                                                        rm_batch=rm_batch)
        return scores, metrics

    def score_with_components(self, ids: Sequence[str], data_sources: Sequence[str], response_texts: Sequence[str],
                              ground_truths: Sequence[str], extras: Optional[Sequence[Mapping[str, Any]]] = None,
                              rm_batch: Any = None, keys: Sequence[str] = ()
                              ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
        """`score`, and `[B, len(keys)]` per-sample components: each key's number in the dict the
        function returned ("score": the sample's score itself). A function that failed (on_error
        zero) gives 0s; one that returned no such number is a RewardError naming the key and the
        sample, whatever on_error says (the config asks for what the function does not give)."""
        n = len(ids)
        extras = list(extras) if extras is not None else [{} for _ in range(n)]
        if not (len(data_sources) == len(response_texts) == len(ground_truths) == len(extras) == n):
            raise RewardError("RewardScorer.score: ids, data_sources, response_texts, ground_truths and extras "
                              "must have one entry per response")
        rule = torch.zeros(n, dtype=torch.float32)
        has_rule = torch.zeros(n, dtype=torch.bool)
        errors = 0
        returned: Dict[str, List[float]] = defaultdict(list)  # extra numbers of dict-returning functions
        fns = [self._function_for(ids[i], data_sources[i]) for i in range(n)]
        rows = [i for i in range(n) if fns[i] is not None]  # the others: reward model only
        results = self.call.call_each(  # one hand-off to the timed worker for the whole batch
            [(fns[i], (data_sources[i], response_texts[i], ground_truths[i], extras[i])) for i in rows],
            stop_at_failure=self.on_error == "raise")  # the first failure ends the step: no more calls
        components = torch.zeros(n, len(keys), dtype=torch.float32)
        named = [j for j, key in enumerate(keys) if key != "score"]
        if named and len(rows) < n:
            first = next(i for i in range(n) if fns[i] is None)
            raise RewardError(f"sample {ids[first]} (data_source {data_sources[first]!r}) is scored by the reward "
                              f"model alone, which gives no {keys[named[0]]!r} (algorithm.gdpo_reward_keys)")
        for i, (ok, out) in zip(rows, results):
            has_rule[i] = True
            try:
                if not ok:
                    raise out
                value, info = _as_score(out)
            except Exception as e:  # noqa: BLE001 - any failure of user/rule code follows on_error
                errors += 1
                self._handle_error(e, ids[i], data_sources[i])
                continue
            rule[i] = value
            for key, v in info.items():
                returned[key].append(v)
            for j in named:
                if keys[j] not in info:
                    raise RewardError(f"reward function {self._name(data_sources[i])} returned no number under "
                                      f"{keys[j]!r} for sample {ids[i]} (data_source {data_sources[i]!r}); "
                                      f"algorithm.gdpo_reward_keys asks for it in every returned dict")
                problem = score_problem(info[keys[j]])
                if problem:  # the components are float32: 1e39 would not fit (and GDPO would divide inf by inf)
                    raise RewardError(f"reward function {self._name(data_sources[i])} returned {keys[j]!r} = "
                                      f"{problem.replace('|score|', f'|{keys[j]}|')} for sample {ids[i]} "
                                      f"(data_source {data_sources[i]!r}; algorithm.gdpo_reward_keys)")
                components[i, j] = info[keys[j]]
        scores = rule
        metrics: Dict[str, float] = {}
        if self.reward_model is not None:
            raw = rm_scores(self.reward_model, rm_batch, n)
            rm = normalize(raw, self.rm_normalize)
            scores = combine(rule, has_rule, rm, self.rm_weight, self.rule_weight)
            metrics["reward/rm/mean"] = float(raw.mean()) if n else 0.0
            metrics["reward/rule/mean"] = float(rule[has_rule].mean()) if has_rule.any() else 0.0
            metrics.update(getattr(self.reward_model, "last_metrics", {}))  # the judge's verdict counts
            agree = getattr(self.reward_model, "agreement", None)
            if agree is not None and has_rule.any():  # where a rule scored too: do the two agree?
                metrics["judge/agreement"] = agree(raw[has_rule], rule[has_rule])
        self.errors_total += errors
        metrics.update(_summaries(scores, data_sources, returned))
        metrics["reward/errors"] = float(errors)
        metrics["reward/errors_total"] = float(self.errors_total)
        for j, key in enumerate(keys):
            if key == "score":
                components[:, j] = scores
        return scores, components, metrics

    def _function_for(self, sample_id: str, data_source: str):
        if self.custom is not None:
            return self.custom
        rule = self.rule_for(data_source)
        if rule is None:
            if self.reward_model is not None:
                return None
            raise RewardError(f"sample {sample_id}: {registry.unknown_source_message(data_source)}")
        return lambda ds, text, truth, extra: rule.fn(text, truth, extra)

    def _name(self, data_source: str) -> str:
        if self.custom is not None:
            return self.custom_name
        rule = self.rule_for(data_source)
        return f"rule '{rule.name}'" if rule is not None else "reward"

    def _handle_error(self, exc: Exception, sample_id: str, data_source: str) -> None:
        where = f"sample {sample_id} (data_source {data_source!r})"
        if self.on_error == "raise":
            if isinstance(exc, RewardTimeout):
                raise RewardError(f"reward function {self._name(data_source)} timed out on {where}: {exc} "
                                  "(set reward.on_error=zero to score such samples 0 and go on)") from None
            what = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, FunctionExited):
                what = f"raised {exc} (a BaseException, which would have ended the rank)"
            raise RewardError(f"reward function {self._name(data_source)} failed on {where}: {what} "
                              "(set reward.on_error=zero to score such samples 0 and go on)") from exc
        if self.first_error is None:
            self.first_error = f"{where}:\n" + "".join(traceback.format_exception(exc))
            log.error("reward function failed on %s; scoring it 0 (reward.on_error=zero); further failures are "
                      "only counted in reward/errors. First traceback:\n%s", where, self.first_error)

    @staticmethod
    def to_token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] zeros with each row's score on its last valid response token (rows without one stay 0)."""
        mask = response_mask.bool()
        if mask.dim() != 2 or scores.shape != (mask.shape[0],):
            raise RewardError(f"to_token_level: scores {tuple(scores.shape)} and response_mask "
                              f"{tuple(response_mask.shape)} must be [B] and [B, T]")
        out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        rows = torch.nonzero(mask.any(dim=1)).flatten()
        last = mask.shape[1] - 1 - mask.flip(1).to(torch.int8).argmax(dim=1)
        out[rows, last[rows]] = scores.to(out)[rows]
        return out


def _as_score(out) -> Tuple[float, Dict[str, float]]:
    """A function's return value as (score, numeric extras); anything else is a failure."""
    info: Dict[str, float] = {}
    if isinstance(out, Mapping):
        if "score" not in out:
            raise RewardError(f"reward function returned a dict without 'score' (keys: {sorted(out)})")
        info = {k: float(v) for k, v in out.items()
                if k != "score" and isinstance(v, numbers.Real) and not isinstance(v, bool)}
        bad = sorted(k for k, v in info.items() if not math.isfinite(v))
        if bad:  # a NaN would turn the run's reward/extra/<key> metric into NaN for good
            raise RewardError(f"reward function returned a non-finite {', '.join(repr(k) for k in bad)} = "
                              f"{', '.join(str(info[k]) for k in bad)} in its dict; every number must be finite")
        out = out["score"]
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if not isinstance(out, numbers.Real):
        raise RewardError(f"reward function returned {reprlib.repr(out)}; expected a finite number or a dict "
                          "with 'score'")
    problem = score_problem(out)
    if problem:
        raise RewardError(f"reward function returned {problem}")
    return float(out), info


def score_problem(value) -> str:
    """'' for a value a reward can be: a number (not a bool: True as a reward is more likely a slip)
    that is finite within float32's range (scores are float32 tensors: 1e39 would overflow there);
    else what is wrong, written to follow "<who> returned ". Reward functions' scores and
    environments' step rewards both go through it."""
    if isinstance(value, bool):
        return f"{value!r} (a bool); return a number, e.g. {float(value)}"
    if not isinstance(value, numbers.Real):
        return f"{reprlib.repr(value)} (a {type(value).__name__}); expected a finite number"
    try:
        number = float(value)
    except OverflowError:  # an int too large for any float
        number = math.inf
    if not math.isfinite(number) or abs(number) > SCORE_MAX:
        return f"{reprlib.repr(value)}; expected a finite number within float32's range (|score| <= {SCORE_MAX:.4g})"
    return ""


def _summaries(scores: torch.Tensor, data_sources: Sequence[str], returned: Dict[str, List[float]]) -> Dict[str, float]:
    metrics = {"reward/score/mean": float(scores.mean()) if len(scores) else 0.0}
    by_source: Dict[str, List[int]] = defaultdict(list)
    for i, ds in enumerate(data_sources):
        by_source[ds].append(i)
    for ds, idx in sorted(by_source.items()):
        metrics[f"reward/score/{ds}"] = float(scores[idx].mean())
    for key, values in sorted(returned.items()):
        metrics[f"reward/extra/{key}"] = sum(values) / len(values)
    return metrics
