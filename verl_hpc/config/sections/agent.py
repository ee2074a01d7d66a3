"""`agent:` any agent program as a rollout, behind an OpenAI-compatible endpoint.

With agent.enable a rollout sample is one run of an agent program: a Python callable
`module:function(row, client_config) -> reward | (reward, info)`, or a command line run in the
sandbox (the `sandbox:` section's limits) with OPENAI_BASE_URL / OPENAI_API_KEY in its
environment and its reward on the last line of its output, that talks to the policy through
`POST /v1/chat/completions` / `POST /v1/completions` on a server each rank runs on the loopback
interface over its own rollout engine. Every completion served is recorded by token id; a sample's
calls become training sequences without re-tokenizing anything (verl_hpc/rollout/agents/).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import WEEK_S, Section, opt
from verl_hpc.config.sections.multi_turn import needs_custom_code

MAX_AGENTS = 1024  # agent threads per rank: past this the rank runs out of threads before the model is busy
# the PATH a command-line agent runs with (the sandbox's minimal environment, sandbox_command.py)
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# words that /bin/sh runs itself: the program after them cannot be named without running the shell
SHELL_WORDS = {"!", "{", "(", ".", ":", "[", "alias", "break", "case", "cd", "command", "continue", "eval",
               "exec", "exit", "export", "for", "if", "read", "return", "set", "shift", "test", "trap", "ulimit",
               "umask", "unset", "until", "wait", "while"}


@dataclass
class AgentConfig(Section):
    enable: bool = opt(False, "each sample is a run of an agent program against the policy's "
                              "OpenAI-compatible endpoint (trainer.job = rl)")
    function: str = opt("", "'package.module:function' run for rows that name no `agent` of their own; "
                            "called as function(row, client_config) -> reward or (reward, info); "
                            "needs safety.allow_custom_code")
    command: str = opt("", "a command line (/bin/sh -c) run in the sandbox for rows that name no agent of their "
                           "own, instead of agent.function: OPENAI_BASE_URL and OPENAI_API_KEY in its "
                           "environment, its reward the last line of its stdout (docs/agents.md); needs "
                           "safety.allow_custom_code")
    read_only_paths: List[str] = opt([], "node folders command-line agents also see, read-only, at their own "
                                         "paths (the agent's code, a Python environment with `openai`)")
    timeout_s: float = opt(120.0, "wall time of one agent run; past it the sample fails (reward.on_error)",
                           check=">0")
    max_calls: int = opt(64, "model calls one agent run may make; further calls get HTTP 429 and the "
                             "sample fails (reward.on_error)", check=">0")
    concurrency: int = opt(64, "agent runs in flight at once on a rank (threads)", check=f"[1, {MAX_AGENTS}]")
    batch_window_ms: float = opt(5.0, "a batch of requests closes after this long without a new one (or 2% of the "
                                      "last generate call's time if longer; 10 such gaps at most; runs not yet "
                                      "called or answered within one call's time are waited for up to one "
                                      "call's time), or at once when every live run has a request in it",
                                 check="[0, 1000]")
    max_batch: int = opt(64, "requests per generate call at most", check=">0")
    port: int = opt(0, "TCP port on 127.0.0.1; 0 = any free port (each rank its own)", check="[0, 65535]")
    model_name: str = opt("policy", "the model name /v1/models lists and requests may name")

    def check(self, job) -> List[str]:
        p: List[str] = []
        if not self.enable:
            return p
        if job.trainer.job != "rl":
            p.append(f"agent.enable is for trainer.job = rl (got {job.trainer.job})")
        if job.multi_turn.enable:
            p.append("agent.enable and multi_turn.enable both drive the episodes: turn one of them off")
        if job.placement.split:
            p.append("agent.enable does not run with placement.mode = split yet: use colocated placement")
        if job.rollout.tp != 1:
            p.append(f"agent.enable needs rollout.tp = 1 (got {job.rollout.tp}): each rank serves its own "
                     "agents from its own engine, without the collective a tensor-parallel engine needs")
        if not job.safety.allow_custom_code:
            p.append(needs_custom_code("agent.command" if self.command and not self.function else "agent.function"))
        if self.function and not all(self.function.partition(":")[::2]):
            p.append(f"agent.function: {self.function!r} is not 'package.module:function'")
        if self.function and self.command.strip():
            p.append("agent.function and agent.command both name the default agent: set one of them")
        if self.command and not self.command.strip():
            p.append("agent.command is blank: give a command line, or leave it empty ('')")
        elif self.command:
            p += command_problems(self.command, "agent.command")
        for k, path in enumerate(self.read_only_paths):
            if not (isinstance(path, str) and path.startswith("/")):
                p.append(f"agent.read_only_paths[{k}]: {path!r} is not an absolute path")
        if self.port and job.slurm.tasks_per_node > 1:
            p.append(f"agent.port = {self.port} with slurm.tasks_per_node = {job.slurm.tasks_per_node}: the ranks of a "
                     "node would all listen on that port; use agent.port = 0 (each rank a free port)")
        if self.timeout_s > WEEK_S:
            p.append(f"agent.timeout_s is capped at one week ({WEEK_S} s)")
        if job.algorithm.adv_estimator == "remax":
            p.append("agent.enable does not run algorithm.adv_estimator = remax (its greedy baseline is one "
                     "response); use grpo, rloo or gae")
        return p


def command_problems(command: str, field: str) -> List[str]:
    """The program a command line starts must exist on this node, or every run ends as a failed
    sample (exit 127) after the job was queued. Checked: the first word after `VAR=value`
    assignments, when it is a program (not a word the shell runs itself, not an expansion): an
    absolute path must be an executable file; a bare name must be on the sandbox's PATH; a relative
    path would be looked up in the run's scratch folder, which holds only row.json."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError as e:
        return [f"{field}: {command!r} is not a shell command line: {e}"]
    if not words:  # '# my agent': /bin/sh runs nothing, and every run ends without a reward
        return [f"{field}: {command!r} is only a comment: it runs nothing; valid: a command line whose last line "
                "of output is the reward"]
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words.pop(0)
    if not words or words[0] in SHELL_WORDS or any(c in words[0] for c in "$`*?[]{}()<>|;&~"):
        return []
    program = words[0]
    if program.startswith("/"):
        if not os.path.isfile(program):
            return [f"{field}: the program {program!r} does not exist on this node"]
        if not os.access(program, os.X_OK):
            return [f"{field}: the program {program!r} is not executable"]
        return []
    if "/" in program:
        return [f"{field}: the program {program!r} is a relative path, but the command runs in its own "
                "scratch folder (row.json only): name it by its absolute path"]
    if shutil.which(program, path=SANDBOX_PATH) is None:
        return [f"{field}: the program {program!r} is not on the sandbox's PATH ({SANDBOX_PATH}): name it by its "
                "absolute path (and list its folder in agent.read_only_paths)"]
    return []


def read_only_problems(paths) -> List[str]:
    """agent.read_only_paths missing on this node: every command-line agent's sandbox would fail to
    mount it. Asked by the submitter before the queue (launcher/preflight.py: a file check, which
    --skip-file-checks skips) and by each rank before it starts the agents' endpoint."""
    return [f"agent.read_only_paths[{k}]: {path!r} does not exist on this node; valid: a folder (or file) "
            "present on every node of the job" for k, path in enumerate(paths)
            if isinstance(path, str) and not os.path.exists(path)]
