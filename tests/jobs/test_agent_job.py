"""An agent program that uses the `openai` client unmodified trains in a one-rank GRPO job (HF
generate rollout, the tiny model): the runs' rewards are the scores, and the actor's log-probs of
the training rows equal what the endpoint recorded the engine sampling (the rows are the sampled ids)."""
from jobs import grpo, logs, metrics


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
