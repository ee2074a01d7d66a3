"""The generative judge: a causal LM reads each question and response and gives a verdict.

    judge = Judge(engine, cfg.reward.reward_model.judge, on_error=cfg.reward.on_error, tokenizer=policy_tok)
    inputs = judge.inputs(step_batch)        # questions (the prompts, decoded), responses, references
    scores = judge.score(inputs)             # FloatTensor [B]; judge.last_metrics: judge/*

The prompt is reward.reward_model.judge.template with {question}, {response} and optionally
{reference} (the sample's ground truth) filled in. Two verdicts:
- pattern: the judge generates (greedy, up to max_tokens) and the first group of `pattern` in its
  text, a number, is the score;
- yes_no: no generation; the judge's next-token log-probs of `yes_token` and `no_token` after the
  prompt give P(yes) / (P(yes) + P(no)), a score in [0, 1].
The engine (a second in-process vLLM engine, rollout/vllm/judge.py, or HF generate, rollout/hf/judge.py)
is called in chunks
of batch_size prompts, each call with timeout_s (on a worker thread, rewards/timeout.py). A verdict
that does not parse, or whose call timed out, follows reward.on_error: zero scores it 0 and counts
it (judge/parse_failures, judge/timeouts, and the run's judge/failures_total); raise stops the job
with a RewardError naming the first such sample. Past judge.max_failure_share of a step's verdicts
the job stops under either setting: a judge that never answers in the expected form would
otherwise train the policy on zeros.

A failed engine (an exception from its call, not a timeout and not the project's own error) is
rebuilt where the judge was given a way to build it (`rebuild`: the roles pass the factory), and
the chunk asked again, at most `max_restarts` times in a job (rollout.max_engine_restarts): the
judge is a frozen model decoding greedily, so the rebuilt engine, loaded from its folder, gives
the verdicts the failed one would have (judge/engine_restarts counts them). Each rank's judge is
an engine of its own (tensor parallel 1), so a rank rebuilds alone, without an agreement.

Sharding: with a process group of several ranks (the training ranks; every rank holds the same
batch), rank r judges rows r, r + world, ... and one SUM all-reduce gives every rank every score
and every failure flag, so every rank takes the same decision about on_error.
"""
from __future__ import annotations

import logging
import math
import re
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from verl_hpc.errors import VerlHpcError
from verl_hpc.rewards.errors import RewardError
from verl_hpc.rewards.timeout import RewardTimeout, TimedCaller
from verl_hpc.runtime import faults
from verl_hpc.runtime.device import collective_device

log = logging.getLogger(__name__)

OK, PARSE_FAILED, TIMED_OUT = 0, 1, 2


class JudgeEngine(Protocol):
    """What the judge needs of an engine (verl_hpc/rollout/hf/judge.py, vllm/judge.py)."""

    def generate(self, prompts: Sequence[str], max_tokens: int) -> List[str]:  # greedy texts
        ...

    def next_token_logprobs(self, prompts: Sequence[str], token_ids: Sequence[int]) -> List[List[float]]:
        ...  # per prompt, the log-prob of each token id as the next token (-inf where unknown)

    def token_id(self, text: str) -> int:  # the id of a one-token text
        ...


class JudgeInputs(NamedTuple):
    ids: List[str]
    questions: List[str]
    responses: List[str]
    references: List[str]


def render(template: str, question: str, response: str, reference: str = "") -> str:
    return template.format(question=question, response=response, reference=reference)


def parse_score(text: str, pattern: "re.Pattern") -> Optional[float]:
    """The first group of the first match as a finite float; None when there is none."""
    m = pattern.search(text)
    if m is None:
        return None
    try:
        value = float(m.group(1))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def yes_share(logp_yes: float, logp_no: float) -> Optional[float]:
    """P(yes) / (P(yes) + P(no)) from two log-probs; None when neither token has any mass."""
    if not (math.isfinite(logp_yes) or math.isfinite(logp_no)):
        return None
    top = max(logp_yes, logp_no)
    a, b = math.exp(logp_yes - top), math.exp(logp_no - top)
    return a / (a + b)


class Judge:
    def __init__(self, engine: JudgeEngine, judge_cfg, *, on_error: str, tokenizer=None,
                 correct_at: float = 0.5, rule_correct_at: float = 1.0, group=None,
                 rebuild: Optional[Callable[[], JudgeEngine]] = None, max_restarts: int = 0):
        """engine: a JudgeEngine; judge_cfg: the reward.reward_model.judge section; tokenizer: the
        policy's (decodes the prompts for {question}); correct_at: the score at or above which a
        verdict says 'right' (yes_no: 0.5), compared with the rule's at rule_correct_at
        (reward.correct_at) in judge/agreement; group: the
        process group the rows are sharded over (None: the default group where one is initialised);
        rebuild: builds the engine again after it failed (None: a failure stops the job), at most
        max_restarts times in the job."""
        self.engine, self.cfg, self.on_error, self.tokenizer = engine, judge_cfg, on_error, tokenizer
        self.correct_at, self.rule_correct_at, self.group = correct_at, rule_correct_at, group
        self.pattern = re.compile(judge_cfg.pattern) if judge_cfg.verdict == "pattern" else None
        self.call = TimedCaller(judge_cfg.timeout_s)
        self.failures_total = 0
        self.last_metrics: Dict[str, float] = {}
        self._yes_no: Optional[Tuple[int, int]] = None
        self.rebuild, self.max_restarts, self.restarts = rebuild, int(max_restarts), 0

    # ------------------------------------------------------------------------------ inputs
    def inputs(self, batch) -> JudgeInputs:
        """The step's rows as text: each prompt decoded from its token ids (special tokens kept out),
        the response texts the rollout decoded, and the ground truths."""
        ids = batch.input_ids
        questions = [self.tokenizer.decode(ids[i, : int(batch.prompt_lengths[i])].tolist(), skip_special_tokens=True)
                     for i in range(len(batch))]
        return JudgeInputs(list(batch.ids), questions, list(batch.response_texts),
                           [str(t) for t in batch.ground_truths])

    # ------------------------------------------------------------------------------ scoring
    def _shard(self, n: int) -> Tuple[List[int], int, int]:
        group = self.group
        if group is None and not dist.is_initialized():
            return list(range(n)), 0, 1
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return list(range(rank, n, size)), rank, size

    def _verdicts(self, prompts: List[str]) -> List[Tuple[int, float]]:
        """(status, score) per prompt, chunk by chunk, each chunk one timed engine call."""
        out: List[Tuple[int, float]] = []
        size = self.cfg.batch_size
        chunks = [prompts[i: i + size] for i in range(0, len(prompts), size)]
        if self.cfg.verdict == "yes_no" and self._yes_no is None:
            self._yes_no = (self.engine.token_id(self.cfg.yes_token), self.engine.token_id(self.cfg.no_token))
        for chunk in chunks:
            ok, result = self._ask(chunk)
            if not ok and self._rebuilt(result):
                ok, result = self._ask(chunk)  # the same chunk on the rebuilt engine
            if not ok:
                if isinstance(result, RewardTimeout):
                    out += [(TIMED_OUT, 0.0)] * len(chunk)
                    continue
                spent = f" (after {self.restarts} rebuild(s) of its engine)" if self.restarts else ""
                raise RewardError(f"the judge's engine failed{spent}: {type(result).__name__}: {result}") from result
            for item in result:
                value = yes_share(*item) if self.cfg.verdict == "yes_no" else parse_score(item, self.pattern)
                out.append((OK, value) if value is not None else (PARSE_FAILED, 0.0))
        return out

    def _ask(self, chunk: List[str]):
        """(True, the engine's answers) or (False, the exception or RewardTimeout) for one chunk.
        The fault-injection hook (VERL_HPC_FAULT's stage `judge`) fires inside the timed call."""
        if self.cfg.verdict == "yes_no":
            fn, args = self.engine.next_token_logprobs, (chunk, self._yes_no)
        else:
            fn, args = self.engine.generate, (chunk, self.cfg.max_tokens)

        def call(*a):
            faults.maybe("judge")
            return fn(*a)

        (ok, result), = self.call.call_each([(call, args)])
        return ok, result

    def _rebuilt(self, error) -> bool:
        """Whether the engine was built again after `error` (an engine's failure, within the bound)."""
        if self.rebuild is None or isinstance(error, (RewardTimeout, VerlHpcError)) \
                or self.restarts >= self.max_restarts:
            return False
        self.restarts += 1
        log.warning("the judge's engine failed (%s: %s); building it again (%d of %d in this job)",
                    type(error).__name__, error, self.restarts, self.max_restarts)
        self.close()
        self.engine = self.rebuild()
        return True

    def score(self, inputs: JudgeInputs) -> torch.Tensor:
        n = len(inputs.ids)
        rows, _, _ = self._shard(n)
        start = time.monotonic()
        prompts = [render(self.cfg.template, inputs.questions[i], inputs.responses[i], inputs.references[i])
                   for i in rows]
        self.wake()
        try:
            verdicts = self._verdicts(prompts) if prompts else []
        finally:
            self.sleep()  # its memory goes back to training until the next step's scoring
        latency = time.monotonic() - start
        scores = torch.zeros(n, dtype=torch.float64)
        status = torch.zeros(n, dtype=torch.float64)
        for i, (code, value) in zip(rows, verdicts):
            scores[i], status[i] = value, code
        if self.group is not None or dist.is_initialized():
            # on the backend's device (NCCL refuses host tensors): one all-reduce, rows disjoint (x + 0 = x)
            packed = torch.stack([scores, status]).to(collective_device())
            dist.all_reduce(packed, group=self.group)
            scores, status = packed[0].cpu(), packed[1].cpu()
            lat = torch.tensor([latency], dtype=torch.float64, device=collective_device())
            dist.all_reduce(lat, op=dist.ReduceOp.MAX, group=self.group)
            latency = float(lat)
        parse_failed = (status == PARSE_FAILED).nonzero().flatten().tolist()
        timed_out = (status == TIMED_OUT).nonzero().flatten().tolist()
        failed = len(parse_failed) + len(timed_out)
        self.failures_total += failed
        self.last_metrics = {"judge/verdict_rate": (n - failed) / n if n else 1.0,
                             "judge/parse_failures": float(len(parse_failed)), "judge/timeouts": float(len(timed_out)),
                             "judge/failures_total": float(self.failures_total), "judge/latency_s": latency,
                             "judge/engine_restarts": float(self.restarts)}
        if failed:
            self._on_failures(inputs, parse_failed, timed_out, n)
        return scores.float()

    def _on_failures(self, inputs: JudgeInputs, parse_failed: List[int], timed_out: List[int], n: int) -> None:
        first = min(parse_failed + timed_out)
        what = ("gave no parseable verdict" if first in parse_failed else
                f"timed out (reward.reward_model.judge.timeout_s = {self.cfg.timeout_s:g})")
        how = (f"pattern {self.cfg.pattern!r}" if self.cfg.verdict == "pattern" else
               f"the log-probs of {self.cfg.yes_token!r} / {self.cfg.no_token!r}")
        share = (len(parse_failed) + len(timed_out)) / n
        if share > self.cfg.max_failure_share:
            raise RewardError(f"the judge failed on {len(parse_failed) + len(timed_out)} of {n} responses this step "
                              f"({len(parse_failed)} without a verdict by {how}, {len(timed_out)} timed out), more than "
                              f"reward.reward_model.judge.max_failure_share = {self.cfg.max_failure_share:g}; first: "
                              f"sample {inputs.ids[first]} {what}")
        if self.on_error == "raise":
            raise RewardError(f"the judge {what} on sample {inputs.ids[first]} (verdict by {how}); set "
                              "reward.on_error=zero to score such responses 0 and go on")

    def agreement(self, rm: torch.Tensor, rule: torch.Tensor) -> float:
        """The share of rows where the judge's verdict (score >= correct_at) and the rule's
        (score >= reward.correct_at) say the same."""
        if rm.numel() == 0:
            return 1.0
        return float(((rm >= self.correct_at) == (rule >= self.rule_correct_at)).float().mean())

    # ------------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        getattr(self.engine, "sleep", lambda: None)()

    def wake(self) -> None:
        getattr(self.engine, "wake", lambda: None)()

    def close(self) -> None:
        """Shut its engine down while the job's process group still exists: a vLLM judge left to
        vLLM's exit-time finalizer tears its groups down after the job dropped its own, and prints a
        traceback after the job's `error:` line."""
        getattr(self.engine, "close", lambda: None)()

    def __enter__(self) -> "Judge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
