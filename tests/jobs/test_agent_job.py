"""An agent program that uses the `openai` client unmodified trains in a one-rank GRPO job (HF
generate rollout, the tiny model): the runs' rewards are the scores, and the actor's log-probs of
the training rows equal what the endpoint recorded the engine sampling (the rows are the sampled ids)."""
import json

import pytest

from jobs import grpo, logs, metrics

K = 4  # rollout.speculative.num_speculative_tokens, set below


def test_an_openai_client_agent_trains_in_a_job(tiny_assets, tmp_path):
    out = tmp_path / "agent"
    proc, _ = grpo(tiny_assets, out, "agent.enable=true", "agent.function=agent_programs:one_call",
                   "safety.allow_custom_code=true", "trainer.total_steps=2", "data.max_response_length=48",
                   "rollout.max_tokens=8", "rollout.engine=hf", "actor.entropy_coeff=0.01",
                   "agent.timeout_s=60", "trainer.val_every=2")
    assert proc.returncode == 0, logs(proc, out)
    val_before, *rows = metrics(out)  # step 0: the validation before training
    assert val_before["step"] == 0 and val_before["val/agent/runs"] == 100
    assert len(rows) == 2
    for m in rows:
        assert m["agent/runs"] == 16 and m["agent/calls"] == 16 and m["agent/failures"] == 0
        assert m["agent/sequences"] == 16
        assert m["reward/score/mean"] == m["agent/reward_mean"]
        # the actor scores the rows trained on; they are the endpoint's sampled ids with its log-probs
        assert m["rollout/logprob_diff_max"] < 1e-3, m["rollout/logprob_diff_max"]
        assert "actor/pg_loss" in m
    assert "agent endpoint on rank 0: http://127.0.0.1:" in proc.stderr
    # validation ran the agent on the 100 val rows (greedy), each run counted once
    val = rows[-1]
    assert val["val/agent/runs"] == 100 and val["val/agent/calls"] == 100
    assert 0.0 <= val["val/acc/all"] <= 1.0


def test_runs_without_a_call_and_bad_requests_do_not_stop_the_job(tiny_assets, tmp_path):
    """Every step's 16 runs: per prompt a run that returns without a call, one that raises before its
    first, one that sends ids outside the vocabulary (400s) then splits into two sequences, one plain;
    and a prompt whose command is not found (exit 127). The no-call runs are counted failures and
    the job trains on the rest; the data_source has no reward function (the runs give the reward);
    reward/score/mean is the runs' mean, though one run in four made two rows."""
    out = tmp_path / "agent"
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "data_source": "my_agent_task", "ground_truth": str(2 * i),
             "extra": {"agent": "agent_programs:mixed"}} for i in range(3)]
    rows.append({"prompt": "7+7=", "data_source": "my_agent_task", "ground_truth": "14",
                 "extra": {"agent_command": "no-such-agent-program --go"}})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc, _ = grpo(tiny_assets, out, "agent.enable=true", "safety.allow_custom_code=true", "trainer.total_steps=2",
                   f"data.train_files=[{data}]", f"data.val_files=[{data}]", "trainer.val_every=2",
                   "data.max_response_length=48", "rollout.max_tokens=8", "actor.entropy_coeff=0.01",
                   "agent.timeout_s=60")
    assert proc.returncode == 0, logs(proc, out)
    val_before, *steps = metrics(out)
    assert len(steps) == 2
    for m in steps:
        assert m["agent/runs"] == 16 and m["agent/failures"] == 10, m
        assert m["agent/failures_no_calls"] == 3 and m["agent/failures_raised"] == 3
        assert m["agent/failures_exited"] == 4
        assert m["agent/calls"] == 9 and m["agent/splits"] == 3 and m["agent/sequences"] == 19
        assert m["reward/score/mean"] == m["agent/reward_mean"] == 3 * (0.75 + 0.25) / 16
        assert "actor/pg_loss" in m and m["rollout/logprob_diff_max"] < 1e-3
    # validation: one run per row, no-call runs counted with reward 0
    val = steps[-1]
    assert val["val/agent/runs"] == 4 and val["val/agent/failures"] == 4  # sample 0 of mixed, and exit 127
    assert val["val/reward/all"] == 0.0
    assert proc.stderr.count("further failures are only counted") == 1  # the first logged, the rest counted


@pytest.mark.numerics  # the trainer's log-probs against vLLM's within 1e-3: make test-portable
def test_the_endpoint_over_the_vllm_engine_trains_on_the_recorded_ids(tiny_assets, tmp_path, recorded):
    """agent.enable over vLLM (CPU) in a job: each run asks, then sends the reply back with one more
    question (its prompt rebuilt from the recorded ids: merged). Every training row is its run's
    calls, id for id and mask for mask, as over HF generate, and the trainer's log-probs of them
    match vLLM's within the usual mismatch bound. With speculation on (rollout.speculative): the
    records stay token-exact, and each step logs its acceptance. The proposer is a drafter (the
    policy's own folder, frozen), which proposes at every decoding step whatever is sampled: n-gram
    lookup proposes only where a sampled token is already in the context, which on this model
    (500 ids, prompts of the tokenizer's 480) is chance, and came to nothing in a step on some CPUs."""
    out = tmp_path / "agent_vllm"
    proc, _ = grpo(tiny_assets, out, "agent.enable=true", "agent.function=agent_programs:two_calls",
                   "safety.allow_custom_code=true", "trainer.total_steps=2", "data.max_response_length=48",
                   "rollout.max_tokens=6", "rollout.engine=vllm", "rollout.kv_cache_memory_bytes=33554432",
                   "actor.entropy_coeff=0.01", "agent.timeout_s=120", f"trainer.rollout_data_dir={out}/rollouts",
                   "rollout.speculative.method=draft_model", f"rollout.speculative.draft_model_path={tiny_assets}/model",
                   f"rollout.speculative.num_speculative_tokens={K}")
    assert proc.returncode == 0, logs(proc, out)
    assert "roles: actor; rollout: vllm" in proc.stderr  # the endpoint served vLLM's samples
    rows = metrics(out)
    calls = recorded
    assert len(rows) == 2 and len(calls) == 2 * 16 * 2
    for m in rows:
        assert m["agent/runs"] == 16 and m["agent/calls"] == 32 and m["agent/failures"] == 0
        assert m["agent/merges"] == 16 and m["agent/sequences"] == 16
        assert m["rollout/logprob_diff_max"] < 1e-3, m["rollout/logprob_diff_max"]
        assert 0.0 <= m["rollout/spec_acceptance"] <= 1.0 and 1.0 <= m["rollout/spec_accepted_length"] <= 1.0 + K, m
    # every call that decoded past its first token had the drafter's proposal at its next step
    for step, m in enumerate(rows):
        decoded = sum(len(c.completion_ids) >= 2 for c in calls[32 * step:32 * (step + 1)])
        assert decoded > 0 and m["rollout/spec_draft_tokens"] >= decoded, (decoded, m)
    dumped = [json.loads(line) for step in (1, 2)
              for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    assert len(dumped) == 32
    # a run's row: its first call's completion (mask 1), the second prompt's new tokens (the template's
    # end of turn and the question: mask 0), the second completion (mask 1), all as recorded
    expected = []
    for c1 in calls:
        for c2 in calls:
            done = c1.prompt_ids + c1.completion_ids
            if c2 is not c1 and c2.prompt_ids[:len(done)] == done:
                gap = c2.prompt_ids[len(done):]
                expected.append((tuple(c1.completion_ids + gap + c2.completion_ids),
                                 tuple([1] * len(c1.completion_ids) + [0] * len(gap) + [1] * len(c2.completion_ids))))
    rows_seen = [(tuple(r["response_ids"]), tuple(r["response_mask"])) for r in dumped]
    assert len(expected) >= 32 and all(row in expected for row in rows_seen) and len(set(rows_seen)) > 1
