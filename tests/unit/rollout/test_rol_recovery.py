"""A failed rollout engine is rebuilt, not fatal (rollout/recovery.py): the faults agreed from the
generate's own gather, the bounds per job and per step, a stall retried once and the second sent the
watchdog's way, the project's own errors not retried, the engine's generate re-running only the
failed shard; the stall watch on vLLM's step loop (rollout/vllm/progress.py); the fault-injection
hook (runtime/faults.py). With stand-in engines: the real engines' rebuilds run in
tests/jobs/test_resilience_job.py."""
import time
from pathlib import Path

import pytest
import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.errors import VerlHpcError
from verl_hpc.rollout.engine import RolloutEngine
from verl_hpc.rollout.recovery import (EngineFault, EngineRecovery, EngineStalled, RestartsExhausted, RolloutEngineError,
                                       fault_of)
from verl_hpc.rollout.replicas import ReplicaLayout
from verl_hpc.rollout.result import ShardOutput
from verl_hpc.rollout.sampling import default_spec
from verl_hpc.rollout.vllm.progress import StallWatch
from verl_hpc.runtime import faults
from verl_hpc.runtime.watchdog import StageStalledError


class Flaky(RolloutEngine):
    """A one-rank engine whose first `fails` shards raise `error`; each row's token is its prompt's index."""
    name = "flaky"

    def __init__(self, fails=1, error=RuntimeError("kernel failed")):
        super().__init__(layout=ReplicaLayout(0, 1, 1), max_prompt_length=16, max_response_length=8,
                         prompt_overflow="truncate", vocab_size=100)
        self.fails, self.error, self.calls, self.rebuilds = fails, error, 0, []

    def _generate_shard(self, prompts, first_index, sampling):
        self.calls += 1
        if self.calls <= self.fails:
            raise self.error
        n = len(prompts)
        return ShardOutput(list(range(first_index, first_index + n)), [0] * n,
                           [[first_index + k] for k in range(n)], [[-0.5] for _ in range(n)], ["length"] * n)

    def rebuild(self, *, smaller):
        self.rebuilds.append(smaller)
        return "smaller" if smaller else ""

    def load_weights(self, weights):
        return {}

    def close(self):
        self._closed = True


PROMPTS = [[1, 2], [3, 4], [5]]


def _recovery(max_restarts=3, per_step=1):
    synced = []
    rec = EngineRecovery(max_restarts, per_step, resync=lambda: synced.append(1))
    rec.new_step(1)
    return rec, synced


def test_a_failed_generate_is_rebuilt_synced_and_run_again():
    engine, (rec, synced) = Flaky(), _recovery()
    engine.recovery = rec
    result = engine.generate(PROMPTS, default_spec(max_tokens=4))
    assert result.response_ids == [[0], [1], [2]] and engine.calls == 2
    assert engine.rebuilds == [False] and synced == [1]
    m = rec.pop_metrics()
    assert m["rollout/engine_restarts"] == 1 and m["rollout/rerun_prompts"] == 3 and m["rollout/restart_seconds"] >= 0
    assert rec.pop_metrics()["rollout/engine_restarts"] == 0  # the step's metrics go once


def test_an_out_of_memory_rebuilds_smaller():
    engine, (rec, _) = Flaky(error=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")), _recovery()
    engine.recovery = rec
    engine.generate(PROMPTS, default_spec(max_tokens=4))
    assert engine.rebuilds == [True]


def test_without_a_recovery_the_engines_own_error_is_raised():
    engine = Flaky(error=ValueError("bad kernel"))
    with pytest.raises(ValueError, match="bad kernel"):
        engine.generate(PROMPTS, default_spec(max_tokens=4))


def test_the_projects_own_error_is_not_retried():
    engine, (rec, _) = Flaky(error=ConfigError("rollout.x: refused")), _recovery()
    engine.recovery = rec
    with pytest.raises(ConfigError, match="rollout.x: refused"):
        engine.generate(PROMPTS, default_spec(max_tokens=4))
    assert engine.rebuilds == []


def test_the_bounds_per_step_and_per_job_end_the_job_in_one_line():
    engine, (rec, _) = Flaky(fails=5), _recovery(max_restarts=3, per_step=1)
    engine.recovery = rec
    with pytest.raises(RestartsExhausted) as e:
        engine.generate(PROMPTS, default_spec(max_tokens=4))
    assert str(e.value) == ("rank 0: rollout engine failed in generate (RuntimeError: kernel failed); restarts "
                            "spent: 1 of rollout.max_engine_restarts_per_step = 1 in step 1")
    assert e.value.exit_code == 33 and engine.rebuilds == [False]
    rec.new_step(2)
    fault = fault_of(RuntimeError("again"), rank=0, replica=0, stage="generate")
    rec.recover(engine, [fault])
    rec.new_step(3)
    rec.recover(engine, [fault])
    rec.new_step(4)
    with pytest.raises(RestartsExhausted, match=r"restarts spent: 3 of rollout.max_engine_restarts = 3 in this job"):
        rec.recover(engine, [fault])


def test_a_second_stall_in_a_step_goes_the_watchdogs_way_with_the_stack():
    engine, (rec, _) = Flaky(fails=0), _recovery(per_step=5)
    stall = fault_of(EngineStalled("no token for 600 s"), rank=1, replica=1, stage="generate")
    assert stall.kind == "stall"
    rec.recover(engine, [stall])
    with pytest.raises(StageStalledError, match=r"rank 1: the rollout engine stalled twice in step 1") as e:
        rec.recover(engine, [stall])
    assert e.value.exit_code == 16
    rec.new_step(2)
    rec.recover(engine, [stall])  # a new step: retried once again


def test_the_fault_kinds():
    kind = lambda e: fault_of(e, rank=0, replica=0, stage="generate").kind  # noqa: E731
    assert kind(RuntimeError("x")) == "error" and kind(EngineStalled("x")) == "stall"
    assert kind(RuntimeError("CUDA error: out of memory")) == "oom" and kind(VerlHpcError("x")) == "fatal"
    # the sync's agreed error quotes the engine's: not the project's own
    sync = VerlHpcError("weight sync failed on rank 1 (RuntimeError: CUDA out of memory)")
    assert fault_of(sync, rank=0, replica=0, stage="load", agreed=True).kind == "oom"
    assert EngineFault(3, 1, "load", "error", "E: x").line() == "rank 3: rollout engine failed in load (E: x)"
    assert issubclass(RolloutEngineError, VerlHpcError)


# ----------------------------------------------------------------------------- the stall watch
def test_the_stall_watch_raises_only_after_the_timeout_without_tokens():
    watch = StallWatch(0.2)
    watch.start()
    watch.observe(0)
    watch.observe(5)  # a token: the clock starts again
    time.sleep(0.25)
    with pytest.raises(EngineStalled, match=r"without producing a token \(rollout.stall_timeout_s = 0.2\)"):
        watch.observe(0)
    off = StallWatch(0)
    off.last_token -= 3600
    off.observe(0)  # 0: off


# ----------------------------------------------------------------------------- the hook
def test_the_fault_spec_is_parsed_and_refused_by_entry():
    assert [str(f) for f in faults.parse("generate:1:4:raise, step:*:2:sigkill")] == ["generate:1:4:raise",
                                                                                    "step:*:2:sigkill"]
    for bad in ("generate:1:4", "gen:1:4:raise", "generate:x:4:raise", "generate:1:0:raise", "load:0:1:stall"):
        with pytest.raises(ValueError, match=r"VERL_HPC_FAULT: entry"):
            faults.parse(bad)


def test_a_fault_fires_once_at_its_rank_and_step_in_the_first_launch_only(monkeypatch):
    monkeypatch.delenv(faults.ATTEMPT_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    try:
        faults.install(1, {faults.ENV: "generate:1:2:raise,update:0:2:raise"})
        faults.at_step(1)
        assert faults.maybe("generate") is None
        faults.at_step(2)
        assert faults.maybe("update") is None  # rank 0's
        with pytest.raises(faults.InjectedFault, match="generate:1:2:raise"):
            faults.maybe("generate")
        assert faults.maybe("generate") is None  # once
        monkeypatch.setenv(faults.ATTEMPT_ENV, "1")  # a restarted launch replays the step healthy
        faults.install(1, {faults.ENV: "generate:1:2:raise"})
        faults.at_step(2)
        assert faults.maybe("generate") is None and faults.active()
    finally:
        faults.install(0, {})
    assert not faults.active()


def test_a_config_cannot_set_the_hook():
    from verl_hpc.config import load_config
    from verl_hpc.config.sections.cluster import FAULT_ENV

    assert FAULT_ENV == faults.ENV
    problems = load_config(Path(__file__).resolve().parents[3] / "configs/smoke.yaml", [f"slurm.env.{FAULT_ENV}=step:0:1:sigkill"]).slurm.check(None)
    assert problems == ["slurm.env.VERL_HPC_FAULT: the fault-injection test hook cannot be set in a config; "
                        "valid: remove it (tests set it in the environment of the submitter)"]


# ----------------------------------------------------------------------------- a VLM's placeholders
def test_a_response_that_samples_an_image_placeholder_ends_before_it():
    """A VLM's image/video placeholder is in its vocabulary and may be sampled; the training forward
    would take it for an image without features. The response ends before it, the tokens kept and
    their log-probs as sampled."""
    from verl_hpc.rollout.engine import cut_at_placeholders, placeholder_ids

    assert placeholder_ids({"image_token_id": 482, "video_token_id": 483, "vision_start_token_id": 480}) == (482, 483)
    assert placeholder_ids({"vocab_size": 500}) == ()
    rows = ShardOutput([0, 0, 1, 1], [0, 1, 0, 1], [[5, 6, 482, 7], [5, 6, 7], [483], [8]],
                       [[-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, -3.0], [-0.5], [-0.25]], ["stop", "stop", "length", "stop"])
    assert cut_at_placeholders(rows, (482, 483)) == 2
    # prompt 1's first response began with a placeholder: it keeps no token, so it takes a copy of the
    # prompt's other response (a response without a token carries no reward and no loss)
    assert rows.response_ids == [[5, 6], [5, 6, 7], [8], [8]]
    assert rows.logprobs == [[-1.0, -2.0], [-1.0, -2.0, -3.0], [-0.25], [-0.25]]
    assert rows.finish_reason == ["length", "stop", "stop", "stop"] and rows.sample_index == [0, 1, 0, 1]
    rows.response_ids[2].append(9)  # a copy, not the same list
    assert rows.response_ids[3] == [8]
    assert cut_at_placeholders(rows, ()) == 0
    # every response of a prompt began with one: the step stops with a line naming the prompt
    rows = ShardOutput([0, 3, 3], [0, 0, 1], [[5], [482, 7], [483]], [[-1.0], [-1.0, -2.0], [-0.5]],
                       ["stop", "stop", "stop"])
    with pytest.raises(ValueError, match=r"every response of prompt 3 began with an image or video placeholder"):
        cut_at_placeholders(rows, (482, 483))
