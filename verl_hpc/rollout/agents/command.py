"""Command-line agents: a command line run once per sample in the sandbox, against the endpoint.

    agents = CommandAgents(sandbox_cfg, read_only_paths, server)      # the sandbox made on first use
    outcome = agents.run(command, row, key, timeout_s)                # never raises for the agent's fault

The command runs as `/bin/sh -c <command>` under the `sandbox:` section's limits (its own wall time
is agent.timeout_s), in a scratch folder holding `row.json` (the row the Python agents get), with
OPENAI_BASE_URL (this run's base URL), OPENAI_API_KEY (the job's token), OPENAI_MODEL and
AGENT_ROW_FILE in its environment, and nothing else of the rank's.

Why the endpoint reaches it through a socket made inside the sandbox: bwrap and namespaces modes
give each run a network namespace of its own, whose 127.0.0.1 is not the rank's, so the rank's TCP
port is out of reach; sharing the node's network instead would let the agent (and whatever
model-written commands a coding agent runs) reach everything the node reaches. The sandbox's first
process makes a socket listening on the run's own loopback and hands it to the rank, which serves
the endpoint on it (verl_hpc/rollout/tools/sandbox_listener.py): an unmodified client, which only
knows a base URL, reaches the policy and nothing else.

The reward is the last non-empty line of stdout: a JSON number, or a JSON object
{"reward": number, "info": {...}}. A non-zero exit or a sandbox limit is the failure `exited`,
the wall time `timeout`, any other last line `bad_reward` (runs.py).
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Dict, Sequence

from verl_hpc.config.errors import raise_if_any
from verl_hpc.config.sections.agent import read_only_problems
from verl_hpc.config.sections.multi_turn import MAX_TOOL_WORKERS
from verl_hpc.rollout.agents.runs import Outcome, verdict

log = logging.getLogger(__name__)
STDERR_TAIL = 2000  # characters of the agent's stderr a failure keeps (the first is logged)


def check_read_only(paths: Sequence[str]) -> None:
    """Before the endpoint starts: a folder missing on this node would fail every run's sandbox
    (the submitter asks the same before the queue: config/sections/agent.py)."""
    raise_if_any(read_only_problems(paths))


class CommandAgents:
    def __init__(self, sandbox_cfg, read_only_paths: Sequence[str], server, model_name: str):
        self.sandbox_cfg, self.read_only = sandbox_cfg, tuple(read_only_paths)
        self.server, self.model_name = server, model_name
        self._sandbox = None
        self._lock = threading.Lock()
        # the sandbox's uids on a root rank are unique among MAX_TOOL_WORKERS runs at once per rank
        # (sandbox.py _run_uid), fewer than agent.concurrency may be
        self._slots = threading.BoundedSemaphore(MAX_TOOL_WORKERS)

    @property
    def sandbox(self):
        """Made on first use (its mode is probed by a trial run): jobs of Python agents need none."""
        with self._lock:
            if self._sandbox is None:
                from verl_hpc.rollout.tools.sandbox import Sandbox

                self._sandbox = Sandbox.from_config(self.sandbox_cfg)
                log.info("command-line agents: %s", self._sandbox.describe())
            return self._sandbox

    def close(self) -> None:
        """The job stops: the commands still running are killed (a Python agent's thread cannot be)."""
        with self._lock:
            if self._sandbox is not None:
                self._sandbox.cancel_all()

    def run(self, command: str, row: Dict[str, Any], key: str, timeout_s: float) -> Outcome:
        env = {"OPENAI_API_KEY": self.server.token, "OPENAI_MODEL": self.model_name, "AGENT_ROW_FILE": "row.json",
               "AGENT_TIMEOUT_S": f"{timeout_s:g}"}
        sandbox = self.sandbox
        with self._slots:
            result = sandbox.run_command(
                command, wall_time_s=timeout_s, env=env, files={"row.json": json.dumps(row)}, read_only=self.read_only,
                serve=self.server.serve_socket, url_env="OPENAI_BASE_URL",
                url=f"http://127.0.0.1:{{port}}/agents/{key}/v1")
        return command_verdict(result, timeout_s)


def command_verdict(result, timeout_s: float) -> Outcome:
    """A SandboxResult as an Outcome: the reward from the last line of stdout, or the failure."""
    tail = result.stderr[-STDERR_TAIL:].rstrip()
    if result.status == "timeout":
        return Outcome(failure="timeout", detail=f"the agent ran past agent.timeout_s = {timeout_s:g} s\n{tail}")
    if not result.ok:
        how = (f"exited with code {result.exit_code}" if result.status in ("error", "denied") and result.exit_code
               is not None else f"was stopped by the sandbox ({result.status})")
        return Outcome(failure="exited", detail=f"the command {how}; its stderr ends:\n{tail}")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    try:
        value = json.loads(last)
    except ValueError:
        value = None
        problem = f"its last line of output is not JSON: {last[:200]!r}" if last else "it printed nothing"
    else:
        problem = ""
    if isinstance(value, dict):
        if "reward" not in value or not isinstance(value.get("info", {}), dict):
            problem = f"its last line {last[:200]!r} is an object without \"reward\" (or with an \"info\" that is no object)"
        else:
            value = (value["reward"], value.get("info", {}))
    if problem:
        return Outcome(failure="bad_reward", detail=f"{problem}; expected a number or "
                                                    "{\"reward\": number, \"info\": {...}} as the last line of stdout")
    return verdict(value)
