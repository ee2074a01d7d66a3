"""Agent runs on two rollout ranks: one GRPO step of a 2-rank job (gloo, HF generate rollout), where
each rank serves the endpoint over its own engine, runs the agents of its own prompts against it,
and both ranks train on one batch that holds exactly the ids both endpoints recorded."""
from pathlib import Path
from urllib.parse import urlsplit

import torch
from jobs import data_overrides, metrics
from rank_launcher import launch_ranks

SCRIPT = Path(__file__).with_name("agent_ranks.py")
PROMPTS, N, CALLS = 4, 2, 2  # data.train_batch_size, rollout.n, calls per run (agent_programs.two_calls)


def test_each_rank_serves_its_own_agents_and_both_train_on_the_recorded_ids(tiny_assets, tmp_path):
    out = tmp_path / "job"
    argv = ["configs/demo_rl.yaml", f"model.path={tiny_assets}/model", *data_overrides(tiny_assets),
            f"trainer.output_dir={out}", "slurm.tasks_per_node=2", "agent.enable=true",
            "agent.function=agent_programs:two_calls", "safety.allow_custom_code=true", "rollout.engine=hf",
            f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size=4", "data.max_response_length=48", "rollout.max_tokens=6",
            "rollout.temperature=1.0", "trainer.total_steps=1", "trainer.val_every=0", "checkpoint.save_every=0",
            "tracking.backends=[jsonl]", "tracking.plots=false", "slurm.cpus_per_task=1", "agent.timeout_s=60"]
    ranks = launch_ranks(SCRIPT, 2, {"argv": argv}, tmp_path / "ranks", timeout=300, what="agent job",
                         log_level="INFO")
    assert [r["code"] for r in ranks] == [0, 0]
    # each rank its own endpoint; its agents were given its own port, and ran its half of the samples
    (p0,), (p1,) = ranks[0]["ports"], ranks[1]["ports"]
    assert p0 != p1
    for r, port in zip(ranks, (p0, p1)):
        assert [urlsplit(u).port for u in r["urls"]] == [port] * (PROMPTS * N // 2)
        assert len(r["calls"]) == PROMPTS * N // 2 * CALLS
    # both ranks train on the same batch, and it holds every call either endpoint recorded
    (rows,), (rows1,) = ranks[0]["batches"], ranks[1]["batches"]
    assert rows == rows1
    calls = ranks[0]["calls"] + ranks[1]["calls"]
    assert sum(sum(row["mask"]) for row in rows) == sum(len(c["completion"]) for c in calls)
    for c in calls:
        full = c["prompt"] + c["completion"]
        row = next(row for row in rows if row["ids"][:len(full)] == full)
        span = slice(len(c["prompt"]) - row["prompt_length"], len(full) - row["prompt_length"])
        assert row["mask"][span] == [1.0] * len(c["completion"])
        assert row["logprobs"][span] == torch.tensor(c["logprobs"], dtype=torch.float32).tolist()
    # a run's second call sent its first reply back unchanged: one merged sequence per run
    assert len(rows) == PROMPTS * N
    # the step trained on them: the actor (FSDP over both ranks) scores the rows as the engines sampled them
    (m,) = metrics(out)
    assert m["agent/runs"] == PROMPTS * N and m["agent/calls"] == PROMPTS * N * CALLS and m["agent/failures"] == 0
    assert m["agent/merges"] == PROMPTS * N and m["agent/splits"] == 0
    assert "actor/pg_loss" in m and m["rollout/logprob_diff_mean"] < 1e-3, m["rollout/logprob_diff_mean"]  # one mini-batch: the objective reports the mean
