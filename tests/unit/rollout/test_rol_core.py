"""The engine-independent parts of rollout: sampling spec, prompts, replicas, results, metrics,
weight-name checks, the shared generate flow (with a fake engine) and the factory's errors."""
import dataclasses
import logging

import pytest
import torch

from verl_hpc.config import ConfigError, validate
from verl_hpc.config.loader import load_config
from verl_hpc.config.schema import choices_of
from verl_hpc.rollout import PromptTooLongError, RolloutEngine, SamplingSpec, build_rollout
from verl_hpc.rollout import engine as engine_mod
from verl_hpc.rollout import factory, rollout_metrics
from verl_hpc.rollout.engine_config import engine_kwargs
from verl_hpc.rollout.prompts import OVERFLOW_POLICIES, check_prompts, fit_prompts
from verl_hpc.rollout.replicas import ReplicaLayout
from verl_hpc.rollout.result import RolloutResult, ShardOutput
from verl_hpc.rollout.sampling import default_spec, request_seed
from verl_hpc.rollout.weights import CheckedWeights
from verl_hpc.trainer.roles import rollout_options


# ------------------------------------------------------------------ SamplingSpec
def test_spec_from_config_and_validation_variant():
    cfg = load_config(None, ["rollout.n=4", "rollout.temperature=0.7", "rollout.top_k=20",
                             "rollout.stop=[\"</s>\"]", "rollout.val_temperature=0",
                             "data.max_response_length=64"])
    spec = SamplingSpec.from_config(cfg.rollout)
    assert (spec.n, spec.temperature, spec.top_k, spec.max_tokens, spec.stop) == (
        4, 0.7, 20, 64, ("</s>",))
    assert not spec.greedy
    val = SamplingSpec.validation_from_config(cfg.rollout)
    assert val.n == 1 and val.greedy and val.max_tokens == 64 and val.stop == ("</s>",)


@pytest.mark.parametrize("override,needle", [
    ("rollout.n=0", "rollout.n"), ("rollout.temperature=-1.0", "rollout.temperature"),
    ("rollout.temperature=0", "rollout.temperature"), ("rollout.top_p=0.0", "rollout.top_p"),
    ("rollout.top_k=0", "rollout.top_k"), ("rollout.max_tokens=-1", "rollout.max_tokens"),
    ("rollout.stop=['']", "rollout.stop"), ("rollout.seed=-3", "rollout.seed")])
def test_spec_values_are_checked_by_the_rollout_section(override, needle):
    """SamplingSpec checks nothing itself: a bad value never gets past the config loader."""
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(None, ["rollout.n=2", override]), check_model=False)


def test_spec_declares_no_defaults():
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(SamplingSpec))
    assert default_spec() == SamplingSpec.from_config(load_config(None).rollout)


def test_step_seeds_are_distinct_and_stable():
    spec = default_spec(seed=5)
    seeds = {spec.for_step(s).seed for s in range(100)}
    assert len(seeds) == 100 and spec.for_step(3) == spec.for_step(3)
    rounds = {spec.for_step(3, k).seed for k in range(5)}  # DAPO's refill rounds of one step
    assert len(rounds) == 5 and spec.for_step(3, 0) == spec.for_step(3)
    assert not rounds & (seeds - {spec.for_step(3).seed})
    assert request_seed(1, 2) == request_seed(1, 2) != request_seed(1, 3)


# ------------------------------------------------------------------ prompts
def test_truncate_keeps_the_last_tokens_and_counts():
    prompts, cut = fit_prompts([[1, 2, 3, 4, 5], [6, 7], [1, 2, 3]], 3, "truncate")
    assert prompts == [[3, 4, 5], [6, 7], [1, 2, 3]] and cut == 1


def test_reject_names_prompt_index_and_limit():
    with pytest.raises(PromptTooLongError, match=r"prompt 1 has 5 tokens.*data.max_prompt_length=3") as e:
        fit_prompts([[1], [1, 2, 3, 4, 5], [9] * 7], 3, "reject")
    assert isinstance(e.value, ValueError) and e.value.too_long == [(1, 5), (2, 7)]


def test_prompt_checks():
    assert check_prompts([(1, 2), torch.tensor([3])], 10) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        check_prompts([[1], []], 10)
    with pytest.raises(ValueError, match="prompt 0 holds token id 10"):
        check_prompts([[10]], 10)
    with pytest.raises(TypeError, match="tokenize first"):
        check_prompts(["hello"], 10)
    with pytest.raises(ValueError, match="prompt_overflow='drop'"):
        fit_prompts([[1]], 3, "drop")


def test_engine_and_overflow_names_are_the_config_choices():
    # the rollout package names what it implements; the config's choices must be the same names
    assert set(choices_of("rollout.prompt_overflow")) == set(OVERFLOW_POLICIES)
    assert set(choices_of("rollout.engine")) == set(factory.ENGINES) | set(factory.CHOOSERS)


# ------------------------------------------------------------------ replicas
def test_replica_layout_and_shards():
    layouts = [ReplicaLayout(rank, 4, 2) for rank in range(4)]
    assert [(lay.replica, lay.tp_rank, lay.is_leader) for lay in layouts] == [
        (0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False)]
    three = ReplicaLayout(0, 3, 1)
    assert [list(three.shard(7, r)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(three.shard(2, r)) for r in range(3)] == [1, 1, 0]
    with pytest.raises(ValueError, match=r"rollout.tp = 3 does not divide the world size 4.*valid: 1, 2, 4"):
        ReplicaLayout(0, 4, 3)


# ------------------------------------------------------------------ results and metrics
def _result():
    return RolloutResult(prompts=[[1, 2], [3]], prompt_index=[0, 0, 1, 1], sample_index=[0, 1, 0, 1],
                         response_ids=[[5, 6, 2], [7], [8, 8], [9, 9, 9, 9]],
                         logprobs=[[-1.0] * 3, [-1.0], [-1.0] * 2, [-1.0] * 4],
                         finish_reason=["stop", "stop", "length", "length"], num_truncated=1,
                         seconds=2.0)


def test_result_and_metrics():
    r = _result()
    assert len(r) == 4 and r.response_lengths == [3, 1, 2, 4] and r.sequence(2) == [3, 8, 8]
    m = rollout_metrics(r)
    assert m["rollout/tokens_per_s"] == 5.0 and m["rollout/response_length_mean"] == 2.5
    assert m["rollout/response_length_max"] == 4 and m["rollout/prompts_truncated"] == 1
    assert m["rollout/finish_stop"] == 2 and m["rollout/finish_length"] == 2
    assert m["rollout/prompts_rejected"] == 0
    with pytest.raises(ValueError, match="differ in length"):
        RolloutResult([[1]], [0], [0], [[1]], [], ["stop"])


# ------------------------------------------------------------------ weight names
def _stream(names):
    return ((n, torch.zeros(2)) for n in names)


def test_checked_weights():
    req = {"a.weight", "b.weight"}
    ok = CheckedWeights(_stream(["b.weight", "lm_head.weight", "a.weight"]), req, {"lm_head.weight"})
    assert [n for n, _ in ok] == ["b.weight", "a.weight"] and ok.bytes == 16 and ok.tensors == 2
    ok.finish()
    with pytest.raises(ValueError, match=r"'a.weigth' is not a weight.*did you mean a.weight"):
        list(CheckedWeights(_stream(["a.weigth"]), req))
    with pytest.raises(ValueError, match="came twice"):
        list(CheckedWeights(_stream(["a.weight", "a.weight"]), req))
    partial = CheckedWeights(_stream(["a.weight"]), req)
    list(partial)
    with pytest.raises(ValueError, match=r"lacks 1 of the model's 2 tensors \(b.weight\)"):
        partial.finish()


# ------------------------------------------------------------------ the shared generate flow
class EchoEngine(RolloutEngine):
    """Responds to prompt i (global index) with [i] * (sample+1): checks flow, order, counts."""
    name = "echo"

    def __init__(self, overflow="truncate", layout=None):
        super().__init__(layout=layout or ReplicaLayout(0, 1, 1), max_prompt_length=4,
                         max_response_length=8, prompt_overflow=overflow, vocab_size=100)
        self.seen = []

    def _generate_shard(self, prompts, first_index, sampling):
        self.seen.append((first_index, prompts))
        rows = ShardOutput.empty()
        for k in range(len(prompts)):
            for j in range(sampling.n):
                rows.prompt_index.append(first_index + k)
                rows.sample_index.append(j)
                rows.response_ids.append([first_index + k] * (j + 1))
                rows.logprobs.append([0.0] * (j + 1))
                rows.finish_reason.append("length")
        return rows

    def load_weights(self, weights):
        return {}

    def close(self):
        self._closed = True


def test_generate_flow_orders_rows_and_counts_truncation():
    eng = EchoEngine()
    r = eng.generate([[1], [1, 2, 3, 4, 5, 6], [7, 8]], default_spec(n=2, max_tokens=8))
    assert r.prompts == [[1], [3, 4, 5, 6], [7, 8]] and r.num_truncated == 1
    assert r.prompt_index == [0, 0, 1, 1, 2, 2] and r.sample_index == [0, 1] * 3
    assert r.response_ids[3] == [1, 1] and r.seconds > 0
    with pytest.raises(ValueError, match="max_tokens=9 exceeds"):
        eng.generate([[1]], default_spec(max_tokens=9))
    with pytest.raises(PromptTooLongError):
        EchoEngine("reject").generate([[1] * 5], default_spec(max_tokens=8))
    eng.close()
    with pytest.raises(RuntimeError, match="after close"):
        eng.generate([[1]], default_spec(max_tokens=8))


def test_broken_engine_refuses_to_generate():
    eng = EchoEngine()
    eng._mark_broken("ValueError: boom")
    with pytest.raises(RuntimeError, match="undefined after a failed load_weights.*boom"):
        eng.generate([[1]], default_spec(max_tokens=8))


def test_with_engine_closes_it_and_keeps_the_error_in_flight(caplog):
    """`with engine:` closes on every way out; a close that fails while an error is already on
    its way is logged, and the error that got there is the one raised (a clean exit raises it)."""
    class FailingClose(EchoEngine):
        def close(self):
            self._closed = True
            raise RuntimeError("shutdown failed")

    with EchoEngine() as eng:
        pass
    assert eng._closed
    with caplog.at_level(logging.WARNING, logger="verl_hpc.rollout.engine"):
        with pytest.raises(KeyError, match="the job's error"), FailingClose() as eng:
            raise KeyError("the job's error")
    assert eng._closed and "close after an error also failed: RuntimeError: shutdown failed" in caplog.text
    with pytest.raises(RuntimeError, match="shutdown failed"), FailingClose():
        pass


def test_sleep_noop_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(engine_mod, "_said", set())
    eng = EchoEngine()
    with caplog.at_level(logging.INFO, logger="verl_hpc.rollout.engine"):
        for _ in range(3):
            eng.sleep()
            eng.wake()
    assert sum("no-ops" in rec.getMessage() for rec in caplog.records) == 1


# ------------------------------------------------------------------ factory
def test_factory_errors(monkeypatch, tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path}"])
    monkeypatch.setattr(factory, "vllm_available", lambda: False)
    with pytest.raises(ConfigError) as e:  # one error line and exit code 2 on a rank
        build_rollout(rollout_options(cfg))
    assert str(e.value) == ("rollout.engine=vllm but vllm is not installed; install the cpu or "
                            "gpu extra, or set rollout.engine=hf")
    with pytest.raises(ConfigError, match="model.path is empty"):
        build_rollout(rollout_options(load_config(None, [])))
    hf_tp2 = load_config(None, [f"model.path={tmp_path}", "rollout.engine=hf", "rollout.tp=2"])
    with pytest.raises(ConfigError, match="rollout.tp=2 needs rollout.engine=vllm"):
        build_rollout(rollout_options(hf_tp2))


def test_engine_kwargs_from_config():
    cfg = load_config(None, ["rollout.tp=2", "data.max_prompt_length=100",
                             "rollout.prompt_overflow=reject", "rollout.max_tokens=0",
                             "data.max_response_length=50", "rollout.sleep_between_phases=true"])
    kw = engine_kwargs(rollout_options(cfg), "vllm")
    assert (kw["tp"], kw["max_prompt_length"], kw["max_response_length"], kw["prompt_overflow"],
            kw["sleep_between_phases"]) == (2, 100, 50, "reject", True)
    assert "sleep_between_phases" not in engine_kwargs(rollout_options(cfg), "hf")
