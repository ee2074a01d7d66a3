"""The generative judge: template, verdict parsers, timeout and parse-failure paths with a fake
engine (reward.on_error, the per-step failure limit), and once with the real HF engine."""
import math
import re
import time
from types import SimpleNamespace

import pytest
import torch

from verl_hpc.config import load_config
from verl_hpc.config.errors import ConfigError
from verl_hpc.rewards.errors import RewardError
from verl_hpc.rewards.judge import Judge, JudgeInputs, parse_score, render, yes_share


def _judge_cfg(*overrides):
    return load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.kind=judge",
                              "reward.reward_model.path=/judge", *overrides]).reward.reward_model.judge


class FakeEngine:
    """Answers from a function of the prompt; counts calls; sleeps `delay` per call."""

    def __init__(self, answer, delay=0.0):
        self.answer, self.delay, self.prompts, self.calls = answer, delay, [], 0
        self.awake = False

    def token_id(self, text):
        return {" yes": 1, " no": 2}[text]

    def generate(self, prompts, max_tokens):
        self.calls += 1
        time.sleep(self.delay)
        self.prompts += prompts
        return [self.answer(p) for p in prompts]

    def next_token_logprobs(self, prompts, token_ids):
        assert list(token_ids) == [1, 2]
        self.calls += 1
        self.prompts += prompts
        return [self.answer(p) for p in prompts]

    def wake(self):
        self.awake = True

    def sleep(self):
        self.awake = False


def _inputs(n):
    return JudgeInputs([f"s{i}" for i in range(n)], [f"what is {i}+{i}?" for i in range(n)],
                       [f"it is {2 * i}" if i % 2 == 0 else "no idea" for i in range(n)],
                       [str(2 * i) for i in range(n)])


def test_template_parser_and_yes_share():
    assert render("Q: {question}\nA: {response}\nRef: {reference}", "1+1", "2", "2") == "Q: 1+1\nA: 2\nRef: 2"
    pat = re.compile(r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)")
    assert parse_score("I think Score: 0.75 overall", pat) == 0.75
    assert parse_score("score=-2 then score=3", pat) == -2.0
    assert parse_score("no number here", pat) is None
    assert parse_score("score: nan", re.compile(r"score: (\w+)")) is None  # not finite: no verdict
    assert yes_share(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert yes_share(-math.inf, math.log(0.2)) == 0.0
    assert yes_share(-math.inf, -math.inf) is None


def test_pattern_verdicts_batched_with_the_template_filled():
    cfg = _judge_cfg("reward.reward_model.judge.verdict=pattern", "reward.reward_model.judge.batch_size=2",
                     "reward.reward_model.judge.template=Q {question} | A {response} | R {reference}")
    eng = FakeEngine(lambda p: "score: 1" if "it is" in p else "score: 0")
    judge = Judge(eng, cfg, on_error="zero")
    scores = judge.score(_inputs(5))
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert eng.calls == 3 and eng.prompts[1] == "Q what is 1+1? | A no idea | R 2"
    assert judge.last_metrics["judge/verdict_rate"] == 1.0 and judge.last_metrics["judge/parse_failures"] == 0
    assert not eng.awake  # asleep again once the step's verdicts are in


def test_yes_no_verdict_from_logprobs():
    cfg = _judge_cfg()  # the default: yes_no
    eng = FakeEngine(lambda p: [math.log(0.9), math.log(0.1)] if "it is" in p else [math.log(0.2), math.log(0.6)])
    scores = Judge(eng, cfg, on_error="zero").score(_inputs(3))
    assert scores.tolist() == pytest.approx([0.9, 0.25, 0.9])


def test_parse_failures_follow_on_error_and_the_limit():
    cfg = _judge_cfg("reward.reward_model.judge.verdict=pattern", "reward.reward_model.judge.max_failure_share=0.5")
    some = FakeEngine(lambda p: "score: 1" if "it is" in p else "I refuse")
    judge = Judge(some, cfg, on_error="zero")
    assert judge.score(_inputs(5)).tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]  # 2 of 5 failed: zero, counted
    assert judge.last_metrics["judge/parse_failures"] == 2 and judge.last_metrics["judge/verdict_rate"] == 0.6
    judge.score(_inputs(3))
    assert judge.last_metrics["judge/failures_total"] == 3
    with pytest.raises(RewardError, match="sample s1"):
        Judge(some, cfg, on_error="raise").score(_inputs(2))
    never = Judge(FakeEngine(lambda p: "looks fine to me"), cfg, on_error="zero")
    with pytest.raises(RewardError) as e:  # a judge that never answers in form stops the job
        never.score(_inputs(4))
    assert "failed on 4 of 4" in str(e.value) and "max_failure_share" in str(e.value) and "\n" not in str(e.value)
    assert never.failures_total == 4


def test_timeouts_are_counted_and_follow_on_error():
    cfg = _judge_cfg("reward.reward_model.judge.verdict=pattern", "reward.reward_model.judge.timeout_s=0.2",
                     "reward.reward_model.judge.max_failure_share=1")
    slow = FakeEngine(lambda p: "score: 1", delay=2.0)
    judge = Judge(slow, cfg, on_error="zero")
    t = time.monotonic()
    assert judge.score(_inputs(3)).tolist() == [0.0, 0.0, 0.0]
    assert time.monotonic() - t < 1.5  # the caller did not wait for the engine
    assert judge.last_metrics["judge/timeouts"] == 3 and judge.last_metrics["judge/verdict_rate"] == 0.0
    with pytest.raises(RewardError, match="timed out"):
        Judge(slow, cfg, on_error="raise").score(_inputs(1))


def test_a_failed_engine_is_rebuilt_and_the_chunk_asked_again_within_the_bound():
    """An exception from the engine's call: the engine closed, built again by `rebuild`, the same
    chunk asked again; at most max_restarts times in the job, then the step's RewardError says how
    many. A timed-out call and the project's own error are not failures of the engine."""
    from verl_hpc.rewards.errors import RewardError as ProjectError

    cfg = _judge_cfg("reward.reward_model.judge.verdict=pattern", "reward.reward_model.judge.batch_size=2")

    class Broken(FakeEngine):
        closed = 0

        def generate(self, prompts, max_tokens):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def close(self):
            Broken.closed += 1

    built = []

    def rebuild():
        built.append(FakeEngine(lambda p: "score: 1" if "it is" in p else "score: 0"))
        return built[-1]

    judge = Judge(Broken(None), cfg, on_error="zero", rebuild=rebuild, max_restarts=2)
    assert judge.score(_inputs(5)).tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]  # the verdicts a healthy engine gives
    assert len(built) == 1 and Broken.closed == 1 and judge.engine is built[0] and built[0].calls == 3
    assert judge.last_metrics["judge/engine_restarts"] == 1.0 and judge.last_metrics["judge/verdict_rate"] == 1.0
    # one rebuild per failed call (the rollout's per-step rule); the bound is the job's: two rebuilds,
    # then the error with the count
    judge = Judge(Broken(None), cfg, on_error="zero", rebuild=lambda: Broken(None), max_restarts=2)
    for count in (1, 2, 2):
        with pytest.raises(RewardError, match=rf"the judge's engine failed \(after {count} rebuild\(s\) of its "
                                              r"engine\): RuntimeError: CUDA error"):
            judge.score(_inputs(5))
        assert judge.restarts == count
    # no rebuild without a way to build it, for the project's own error, or for a timeout
    with pytest.raises(RewardError, match=r"the judge's engine failed: RuntimeError"):
        Judge(Broken(None), cfg, on_error="zero").score(_inputs(1))

    class Refusing(FakeEngine):
        def generate(self, prompts, max_tokens):
            raise ProjectError("a prompt longer than the judge's window")

    judge = Judge(Refusing(None), cfg, on_error="zero", rebuild=rebuild, max_restarts=2)
    with pytest.raises(RewardError, match="longer than the judge's window"):
        judge.score(_inputs(1))
    assert judge.restarts == 0
    slow = Judge(FakeEngine(lambda p: "score: 1", delay=0.3),
                 _judge_cfg("reward.reward_model.judge.verdict=pattern", "reward.reward_model.judge.timeout_s=0.05",
                            "reward.reward_model.judge.max_failure_share=1"),
                 on_error="zero", rebuild=rebuild, max_restarts=2)
    slow.score(_inputs(1))
    assert slow.restarts == 0 and slow.last_metrics["judge/timeouts"] == 1


def test_an_injected_judge_fault_is_rebuilt_on_the_real_hf_engine(tmp_path, monkeypatch):
    """VERL_HPC_FAULT's stage `judge` fires inside the engine's call; the HF engine built again from
    the folder gives the verdicts the first one gave."""
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout.hf.judge import HFJudgeEngine
    from verl_hpc.runtime import faults

    folder = make_tiny_model(tmp_path / "judge", "llama", layers=2, seed=3)
    cfg = _judge_cfg("reward.reward_model.judge.verdict=pattern", "reward.reward_model.judge.max_tokens=4",
                     r"reward.reward_model.judge.pattern='(\d)'", "reward.reward_model.judge.timeout_s=120")
    inputs = _inputs(3)
    healthy = Judge(HFJudgeEngine(str(folder)), cfg, on_error="zero")
    want, want_metrics = healthy.score(inputs), dict(healthy.last_metrics)
    monkeypatch.delenv(faults.ATTEMPT_ENV, raising=False)
    try:
        faults.install(0, {faults.ENV: "judge:0:2:raise"})
        faults.at_step(2)
        judge = Judge(HFJudgeEngine(str(folder)), cfg, on_error="zero",
                      rebuild=lambda: HFJudgeEngine(str(folder)), max_restarts=1)
        got = judge.score(inputs)
    finally:
        faults.install(0, {})
    assert torch.equal(got, want) and judge.restarts == 1
    assert judge.last_metrics["judge/verdict_rate"] == want_metrics["judge/verdict_rate"]


def test_agreement_with_the_rule():
    judge = Judge(FakeEngine(lambda p: ""), _judge_cfg(), on_error="zero", rule_correct_at=1.0)
    assert judge.agreement(torch.tensor([0.9, 0.2, 0.7, 0.1]), torch.tensor([1.0, 0.0, 0.0, 0.0])) == 0.75


@pytest.mark.parametrize("template, match", [
    ("Q: {question} -- is it right?", "no {response} placeholder"),
    ("{response} {answer}", "unknown placeholder"),
    ("{response} {", "not a format string")])
def test_template_refused_before_the_queue(template, match):
    from verl_hpc.config import validate

    cfg = load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.kind=judge",
                             "reward.reward_model.path=/judge", f"reward.reward_model.judge.template={template}"])
    with pytest.raises(ConfigError, match=match) as e:
        validate(cfg, check_model=False)
    line = next(p for p in e.value.problems if match in p)
    assert line.startswith("reward.reward_model.judge.template:") and "\n" not in line


def test_real_hf_engine_gives_the_verdicts_transformers_gives(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout.hf.judge import HFJudgeEngine

    folder = make_tiny_model(tmp_path / "judge", "llama", layers=2, seed=3)
    tok = AutoTokenizer.from_pretrained(folder)
    yes, no = [t for t in ("yes", "no", "a", "b") if len(tok.encode(t, add_special_tokens=False)) == 1][:2]
    cfg = _judge_cfg(f"reward.reward_model.judge.yes_token={yes}", f"reward.reward_model.judge.no_token={no}",
                     "reward.reward_model.judge.template={question} = {response}")
    eng = HFJudgeEngine(str(folder))
    inputs = JudgeInputs(["a", "b"], ["one plus one", "two"], ["two", "three is the answer"], ["", ""])
    scores = Judge(eng, cfg, on_error="raise").score(inputs)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ids = [tok.encode(t, add_special_tokens=False)[0] for t in (yes, no)]
    for i, text in enumerate(["one plus one = two", "two = three is the answer"]):
        with torch.no_grad():
            logp = torch.log_softmax(hf(**tok(text, return_tensors="pt")).logits[0, -1], -1)
        p = torch.exp(logp[ids])
        assert float(scores[i]) == pytest.approx(float(p[0] / p.sum()), abs=1e-5)  # left padding changes nothing
    texts = eng.generate(["one plus one", "two"], 4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)



def test_judge_reduces_its_verdicts_on_the_backends_device(one_rank_world, monkeypatch):
    """The verdicts' all-reduces take the runtime's collective device (NCCL refuses host tensors;
    the first GPU run's reading of this code). On gloo that device is the CPU: the test records
    that the judge asks the runtime and that every payload is where it answered."""
    import torch.distributed as dist

    from verl_hpc.rewards import judge as judge_mod

    asked, payloads, real = [], [], dist.all_reduce
    monkeypatch.setattr(judge_mod, "collective_device", lambda: asked.append(1) or torch.device("cpu"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: payloads.append(t.device) or real(t, *a, **k))
    judge = Judge(FakeEngine(lambda p: "score: 1"), _judge_cfg("reward.reward_model.judge.verdict=pattern"),
                  on_error="zero")
    assert judge.score(_inputs(3)).tolist() == [1.0, 1.0, 1.0]
    assert len(asked) == 2 and payloads == [torch.device("cpu")] * 2


def test_a_vllm_judge_beside_a_vllm_rollout_on_a_gpu(monkeypatch):
    """vLLM's sleep allocator and parallel state are one per process: on a GPU, auto picks HF
    generate for a judge that shares its process with a vLLM rollout, and an explicit vllm is
    refused before any engine is built. On CPU (no sleep mode) the two coexist."""
    from verl_hpc.rollout import factory

    auto = _judge_cfg()
    assert not auto.uses_vllm(True, beside_vllm_rollout=True)
    assert auto.uses_vllm(False, beside_vllm_rollout=True) is False  # CPU: auto is HF anyway
    explicit = load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.kind=judge",
                                  "reward.reward_model.path=/judge", "reward.reward_model.judge.engine=vllm"]).reward
    assert explicit.reward_model.judge.uses_vllm(False, beside_vllm_rollout=True)
    monkeypatch.setattr(factory.devices, "has_gpu", lambda: True)
    with pytest.raises(RewardError, match=r"judge.engine = vllm beside this rank's vLLM rollout on a GPU"):
        factory.build_judge_engine(explicit, beside_vllm_rollout=True)
