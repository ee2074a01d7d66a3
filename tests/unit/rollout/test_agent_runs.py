"""Agent runs on the real rollout engine (HF generate, the tiny model): the training batch holds
exactly the ids the endpoint recorded, over 512 calls with rewritten histories; every bad agent ends
as a counted sample failure; the sampled log-probs are the model's own (a teacher-forced forward)."""
import pytest
import torch
from transformers import AutoTokenizer

from verl_hpc.config import load_config
from verl_hpc.data.batch import PromptBatch
from verl_hpc.rewards.errors import RewardError
from verl_hpc.rollout.agents import AgentOptions, AgentRunner
from verl_hpc.algorithms.masked import check_response_mask
from verl_hpc.config import ConfigError
from verl_hpc.rollout.agents.runner import untrained_rows
from verl_hpc.rollout.agents.metrics import agent_metrics
from verl_hpc.rollout.sampling import default_spec
from verl_hpc.trainer.stages.batching import assemble
from verl_hpc.trainer.stages.scoring import given_rewards

SPEC = default_spec(n=4, max_tokens=6, temperature=1.0, top_p=1.0, top_k=-1)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from verl_hpc.rollout import HFRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    eng = HFRollout(tiny_model, batch_size=64, **default_engine_args("hf", max_prompt_length=192, max_response_length=64))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def runner(engine, tok, *overrides, on_error="zero"):
    cfg = load_config(None, ["agent.enable=true", "agent.function=agent_programs:conversation", *overrides])
    return AgentRunner(engine, tok, AgentOptions(cfg.agent, on_error, True, 6))


def batch_of(prompts: int, agents=None, tok=None):
    agents = agents or [None] * prompts
    return PromptBatch(ids=[f"row{i}" for i in range(prompts)], prompt_ids=[[3, 20 + i, 4] for i in range(prompts)],
                       prompt_texts=[f"{i}+{i}=" for i in range(prompts)], data_sources=["synthetic"] * prompts,
                       ground_truths=[str(2 * i) for i in range(prompts)],
                       extras=[{"agent": a} if a else {} for a in agents])


def row_ids(batch, r):
    n = int(batch.prompt_lengths[r] + batch.response_lengths[r])
    return batch.input_ids[r, :n].tolist()


@pytest.mark.heavy
def test_the_training_batch_holds_the_recorded_ids_over_512_calls(engine, tok, recorded, tiny_model):
    prompts = batch_of(16)
    with runner(engine, tok) as r:
        result = r.generate(prompts, SPEC)
        assert r.batcher.generate_calls < len(recorded) / 4  # batched, not served one by one
    assert len(recorded) == 16 * 4 * 8 >= 500
    m = agent_metrics(result)
    assert m["agent/calls"] == 512 and m["agent/failures"] == 0
    # per run: calls 2, 3, 5 and 6 send back the endpoint's replies (their prompts rebuilt from the
    # recorded ids: merged), and so does call 7 up to call 5's reply, before the edited one; the
    # truncation and the raw completion always split; the edited reply splits unless its text
    # happens to encode to the sampled ids plus more
    assert m["agent/history_reused"] == 64 * 5
    assert m["agent/merges"] + m["agent/splits"] == 64 * 7
    assert m["agent/merges"] >= 64 * 4 and m["agent/splits"] >= 64 * 2
    batch = assemble(prompts, result, tok, pad_id=0)
    mask, logp = batch.response_mask, batch.rollout_log_probs
    assert int(mask.sum()) == sum(len(c.completion_ids) for c in recorded)  # every sampled token once
    rows = [row_ids(batch, r) for r in range(len(batch))]
    for call in recorded:
        full = call.prompt_ids + call.completion_ids
        hits = [r for r, ids in enumerate(rows) if ids[:len(full)] == full]
        assert hits, "a recorded call is in no training row"
        r = hits[0]
        p = int(batch.prompt_lengths[r])
        span = slice(len(call.prompt_ids) - p, len(full) - p)
        assert mask[r, span].tolist() == [1.0] * len(call.completion_ids)
        assert torch.equal(logp[r, span], torch.tensor(call.logprobs, dtype=torch.float32))
    # the rows' scores are the runs' rewards; the rows of a run share them
    scores = given_rewards(torch.zeros(len(batch)), result, {})
    assert scores.tolist() == [1.0 if e.agent and j % 2 == 0 else 0.0 for e, j in zip(result.episodes, result.sample_index)]
    # the sampled log-probs are the model's (temperature 1, no top-p/k): a teacher-forced forward agrees
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    for r in range(0, len(batch), 37):
        ids = torch.tensor([rows[r]])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
        p = int(batch.prompt_lengths[r])
        on = mask[r, :len(rows[r]) - p].bool()
        assert torch.allclose(lp[p - 1:][on], logp[r, :len(rows[r]) - p][on], atol=1e-4)


BAD = {"agent_programs:raises": "raised", "agent_programs:exits": "raised", "agent_programs:raises_first": "raised",
       "agent_programs:floods": "flooded", "agent_programs:floods_and_raises": "flooded",
       "agent_programs:no_calls": "no_calls",
       "agent_programs:nan_reward": "bad_reward", "agent_programs:bool_reward": "bad_reward",
       "agent_programs:bad_tuple": "bad_reward"}


def test_each_bad_agent_is_a_counted_sample_failure_and_the_batch_goes_on(engine, tok, caplog):
    agents = [*BAD, "agent_programs:one_call"]
    prompts = batch_of(len(agents), agents)
    spec = default_spec(n=1, max_tokens=6, temperature=1.0)
    with runner(engine, tok, "agent.timeout_s=20", "agent.max_calls=4") as r:
        with caplog.at_level("ERROR"):
            result = r.generate(prompts, spec)
        assert r.failures_total == len(BAD)
    first = {}
    for i, e in zip(result.prompt_index, result.episodes):
        first.setdefault(i, e.agent)
    assert [first[i].failure for i in range(len(BAD))] == list(BAD.values())
    assert first[len(BAD)].failure == ""
    assert all(first[i].reward == 0.0 for i in range(len(BAD)))
    m = agent_metrics(result)
    assert m["agent/failures"] == len(BAD) and m["agent/failures_bad_reward"] == 3
    assert sum("agent run failed" in rec.message for rec in caplog.records) == 1  # the first, once
    assert "KeyError: \"the agent's own bug\"" in r.first_failure
    batch = assemble(prompts, result, tok, pad_id=0)
    assert len(set(batch.group_ids.tolist())) == len(agents)  # every sample kept its place in a group
    # the runs without a model call (exits, raises_first, no_calls): their rows, the data prompt
    # alone, are marked; the step trains on the others, each with a sampled token
    no_call = {i for i, name in enumerate(BAD) if name.split(":")[1] in ("exits", "raises_first", "no_calls")}
    untrained = untrained_rows(result)
    assert {result.prompt_index[r] for r in untrained} == no_call
    assert all(not result.response_ids[r] and batch.response_mask[r].sum() == 0 for r in untrained)
    keep = torch.ones(len(batch), dtype=torch.bool)
    keep[untrained] = False
    check_response_mask(batch.select(keep).response_mask)  # what the advantage step refused before
    with pytest.raises(ValueError, match="zero-length responses"):
        check_response_mask(batch.response_mask)


def test_an_agent_past_its_time_limit_is_a_counted_timeout(engine, tok):
    """Apart from the others, with a 1 s limit: the time limit is what the test waits for (the
    other agents keep a generous 20 s, which a loaded machine needs for a model call or two)."""
    prompts = batch_of(2, ["agent_programs:sleeps", "agent_programs:one_call"])
    with runner(engine, tok, "agent.timeout_s=1", "agent.max_calls=4") as r:
        result = r.generate(prompts, default_spec(n=1, max_tokens=6, temperature=1.0))
        assert r.failures_total == 1
    failures = {i: e.agent.failure for i, e in zip(result.prompt_index, result.episodes)}
    assert failures[0] == "timeout" and agent_metrics(result)["agent/failures"] == 1


def test_on_error_raise_stops_with_the_sample_named(engine, tok):
    with runner(engine, tok, on_error="raise") as r:
        with pytest.raises(RewardError, match=r"sample row0: agent run failed \(no_calls\).*reward.on_error=zero"):
            r.generate(batch_of(1, ["agent_programs:no_calls"]), default_spec(n=1, max_tokens=4))


def test_a_training_batch_where_no_run_made_a_call_stops_with_the_first_failure(engine, tok):
    with runner(engine, tok) as r:
        result = r.generate(batch_of(1, ["agent_programs:no_calls"]), default_spec(n=2, max_tokens=4))
    with pytest.raises(RewardError, match=r"none of the 2 agent runs .* made a model call.*first failed: no_calls"):
        untrained_rows(result)


def test_a_call_after_its_run_ended_gets_409_and_a_taken_port_is_named(engine, tok):
    import openai

    import agent_programs

    agent_programs.ENDED_URLS.clear()
    with runner(engine, tok, "agent.function=agent_programs:one_call_and_remember") as r:
        r.generate(batch_of(1), default_spec(n=1, max_tokens=4))
        [(url, key)] = agent_programs.ENDED_URLS
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        with pytest.raises(openai.ConflictError, match="run has ended"):  # as docs/agents.md says, not 404
            client.completions.create(model="policy", prompt=[5], max_tokens=2)
        taken = r.server.port
        with pytest.raises(ConfigError, match=f"agent.port = {taken} is already in use on this node"):
            runner(engine, tok, f"agent.port={taken}")
