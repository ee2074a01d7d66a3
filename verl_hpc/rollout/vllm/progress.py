"""rollout.stall_timeout_s on vLLM's own step loop: a generate whose engine keeps stepping without
producing a token for that long raises EngineStalled from inside the loop, and the recovery
rebuilds the engine (rollout/recovery.py). The wall time of the whole stage is not the measure: a
long generation that produces tokens is never a stall; a first step that prefills many long
prompts produces none until it ends, hence a default of minutes, not seconds.

How: the in-process engine's `LLM.generate` calls `llm_engine.step()` until no request is left,
and each step takes the engine core's outputs from `llm_engine.engine_core.get_output()` (vLLM
0.25 and 0.32 alike: EngineCoreOutputs, each request's `new_token_ids`). This engine's own client
object gets a wrapper of that method which notes when a token last came (one Python call per
step); nothing of vLLM's classes changes. With the watch off (timeout 0) it never raises. A step that never returns (a
kernel that hangs) is outside its reach: the stage watchdog (runtime/watchdog.py) ends the rank
then, and the in-allocation restart brings the job back.

The test hook (`VERL_HPC_FAULT=generate:R:S:stall`, runtime/faults.py) makes the next generate's
steps return no outputs without running the engine: the same watch then catches it.
"""
from __future__ import annotations

import time

from verl_hpc.rollout.recovery import EngineStalled

IDLE_STEP_S = 0.01  # an injected stall's step: no work, a little time, as an idle engine's


class StallWatch:
    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.last_token = time.monotonic()
        self.steps_without_tokens = 0
        self.inject = False  # the test hook: the next generate stalls

    def attach(self, llm) -> None:
        """Wrap this engine's core client's get_output (the instance's, not vLLM's class)."""
        core = llm.llm_engine.engine_core
        real = core.get_output

        def get_output():
            if self.inject:
                from vllm.v1.engine import EngineCoreOutputs

                time.sleep(IDLE_STEP_S)
                out = EngineCoreOutputs()
            else:
                out = real()
            self.observe(sum(len(o.new_token_ids or ()) for o in out.outputs))
            return out

        core.get_output = get_output

    def start(self) -> None:
        """At the start of a generate: the clock starts again."""
        self.last_token, self.steps_without_tokens = time.monotonic(), 0

    def observe(self, tokens: int) -> None:
        """After one engine step that produced `tokens`; raises past the timeout without any."""
        now = time.monotonic()
        if tokens:
            self.last_token, self.steps_without_tokens = now, 0
            return
        self.steps_without_tokens += 1
        if self.timeout_s > 0 and now - self.last_token > self.timeout_s:
            self.inject = False  # the rebuilt engine runs healthy
            raise EngineStalled(f"vLLM stepped {self.steps_without_tokens} times in {now - self.last_token:.0f} s "
                                f"without producing a token (rollout.stall_timeout_s = {self.timeout_s:g})")
