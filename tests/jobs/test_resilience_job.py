"""A failed rollout engine costs a step's seconds, not the job (issue 94, item 1, 2 and 4): a tiny GRPO
job over two-turn episodes with in-process vLLM and a fault injected at a chosen step (`VERL_HPC_FAULT`, runtime/faults.py)
finishes every step in the same process, counts its restarts, and ends with the same weights as the
job without the fault, bitwise: the engine rebuilt, the current weights synced into it, the failed
prompts generated again with their own seeds. Past rollout.max_engine_restarts the job saves its
last step and stops with one line. (Two ranks with the fault on one: tests/dist/test_resilience_ranks.py.)"""
import pytest
import torch

from jobs import MOVING, grpo, logs, metrics, read_all

VLLM = ["rollout.engine=vllm", "checkpoint.save_every=0"]
# multi-turn episodes (two model turns, tests/agent_env.py): the episodes' records live outside the
# engine, so a rebuilt engine's retried turn must leave them as a run without the fault has them
EPISODES = ["multi_turn.enable=true", "multi_turn.environment=agent_env:OneMoreTurn", "safety.allow_custom_code=true",
            "data.max_response_length=64", "rollout.max_tokens=8"]
# every engine fault once: an exception in generate (step 2), in the weight load (step 3: the lazy
# sync runs at the step's start), an out-of-memory (step 4: rebuilt with half the sequences), a stall
# (step 5: the engine steps without producing a token; the watch's timeout is cut to 2 s here)
ALL_FAULTS = "generate:0:2:raise,load:0:3:raise,generate:0:4:oom,generate:0:5:stall"


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    proc, _ = grpo(tiny_assets, out, "trainer.total_steps=5", *VLLM, *MOVING, *EPISODES)
    assert proc.returncode == 0, logs(proc, out)
    return out


def test_every_engine_fault_is_recovered_and_the_run_ends_as_without_it(tiny_assets, straight, tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_HPC_FAULT", ALL_FAULTS)
    proc, summary = grpo(tiny_assets, tmp_path, "trainer.total_steps=5", *VLLM, *MOVING, *EPISODES,
                         "rollout.max_engine_restarts=4", "rollout.stall_timeout_s=2")
    assert proc.returncode == 0 and summary["steps"] == 5, logs(proc, tmp_path)
    text = proc.stdout + proc.stderr
    rows = metrics(tmp_path)
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 1, 1, 1, 1]
    assert [r["rollout/engine_restarts_total"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["rollout/rerun_prompts"] for r in rows] == [0, 4, 0, 4, 4]  # the load's: none to generate again
    assert all(r["rollout/restart_seconds"] > 0 for r in rows[1:])
    for line in ("rank 0: rollout engine failed in generate (InjectedFault: injected fault generate:0:2:raise)",
                 "rollout engine failed in load", "(OutOfMemoryError: CUDA out of memory (injected fault",
                 "rollout max_num_seqs", "without producing a token (rollout.stall_timeout_s = 2)"):
        assert line in text, line
    a, b = read_all(straight / "checkpoints"), read_all(tmp_path / "checkpoints")
    assert sorted(a) == sorted(b)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []  # bitwise


def test_past_its_restarts_the_job_saves_its_last_step_and_stops_in_one_line(tiny_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_HPC_FAULT", "generate:0:2:raise,generate:0:3:raise")
    proc, _ = grpo(tiny_assets, tmp_path, "trainer.total_steps=4", *VLLM, "rollout.max_engine_restarts=1")
    assert proc.returncode == 33, logs(proc, tmp_path)
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert errors == ["error: rank 0: rollout engine failed in generate (InjectedFault: injected fault "
                      "generate:0:3:raise); restarts spent: 1 of rollout.max_engine_restarts = 1 in this job"], errors
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"  # the steps done, saved
