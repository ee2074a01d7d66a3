"""`multi_turn:` episodes of model and tool turns; `sandbox:` where model-written code runs.

With multi_turn.enable a rollout sample is an episode: the model writes a turn, a tool call in it
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Hermes/Qwen format most chat
templates use) is run and its output appended as a tool turn, and the model goes on, until it
answers without a call, or max_turns, the token budget (data.max_response_length for the whole
episode after the prompt) or episode_timeout_s ends it. The model's tokens are kept exactly as
generated; tool output and the chat template's turn delimiters are tokenized once and appended
with loss mask 0 (verl_hpc/rollout/episodes/runner.py).

The sandbox runs the `python` tool's code in a process of its own with CPU time, memory, process
and output limits and a private scratch folder; `mode` picks how much of the node it can see
(docs/sandbox.md says what each mode isolates and what it does not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import WEEK_S, Section, opt

BUILTIN_TOOLS = ("calculator", "python")
TOOL_FORMATS = ("hermes",)  # <tool_call>{json}</tool_call>
SANDBOX_MODES = ("auto", "bwrap", "namespaces", "rlimits")
UID_SPAN = 1 << 24  # the uids a root rank's sandbox runs take from sandbox.uid_base on
# above the id ranges accounts and SSSD/winbind id mapping use by default (SSSD: 200000-2000200000)
DEFAULT_UID_BASE = 2_100_000_000
# Each tool worker is a thread that may drive a sandbox process (sandbox.memory_mb each); past a few
# hundred per rank the node runs out of memory or processes first, and a value such as 1000000 failed
# at start-up with "can't start new thread" instead of a range error.
MAX_TOOL_WORKERS = 256


def needs_custom_code(field: str) -> str:
    """The refusal of user tools and environments without safety.allow_custom_code: one wording
    for the config check and for the tool registry, which refuses again where it loads the code."""
    return f"{field} runs your own code: set safety.allow_custom_code=true to allow it"


@dataclass
class MultiTurnConfig(Section):
    enable: bool = opt(False, "each sample is an episode of model and tool turns (trainer.job = rl)")
    max_turns: int = opt(4, "model turns per episode at most", check=">0")
    tools: List[str] = opt(list(BUILTIN_TOOLS), "tools offered to every row that names none itself "
                                                "(a row's `tools` field picks among these and user_tools)",
                           choices=BUILTIN_TOOLS)
    user_tools: List[str] = opt([], "your own tools, 'package.module:function' (called with the call's "
                                    "arguments, returns text); needs safety.allow_custom_code")
    environment: str = opt("", "'package.module:Class' with reset(row) and step(turn_text) -> (observation, "
                               "reward, done), instead of tool calls; needs safety.allow_custom_code")
    format: str = opt("hermes", "how the model writes a tool call", choices=TOOL_FORMATS)
    max_calls_per_turn: int = opt(4, "tool calls run per model turn; more are answered with an error", check=">0")
    max_tool_output_chars: int = opt(2000, "a tool's output is cut to this many characters", check=">0")
    tool_timeout_s: float = opt(10.0, "wall time of one tool call", check=">0")
    episode_timeout_s: float = opt(0.0, "wall time of one batch's episodes from their first turn; 0 = no limit",
                                   check=">=0")
    tool_workers: int = opt(0, "tool calls run at once (threads driving sandbox processes); 0 = the cores "
                               "the rank leaves free: slurm.cpus_per_task - 1, at least 1",
                            check=f"[0, {MAX_TOOL_WORKERS}]")
    tool_error_penalty: float = opt(0.0, "per-turn reward term added for each failed tool call (malformed, "
                                         "unknown tool, error, timeout); e.g. -0.1")

    def check(self, job) -> List[str]:
        p = []
        if not self.enable:
            return p
        if job.trainer.job != "rl":
            p.append(f"multi_turn.enable is for trainer.job = rl (got {job.trainer.job})")
        if job.placement.split:
            p.append("multi_turn.enable does not run with placement.mode = split yet: use colocated placement")
        if (self.user_tools or self.environment) and not job.safety.allow_custom_code:
            p.append(needs_custom_code("multi_turn.environment" if self.environment else "multi_turn.user_tools"))
        for spec in [*self.user_tools, *([self.environment] if self.environment else [])]:
            module, _, name = spec.partition(":")
            if not module or not name:
                p.append(f"multi_turn: {spec!r} is not 'package.module:name'")
        if self.tool_timeout_s > WEEK_S or self.episode_timeout_s > WEEK_S:
            p.append(f"multi_turn timeouts are capped at one week ({WEEK_S} s)")
        if job.algorithm.adv_estimator == "remax":
            p.append("multi_turn.enable does not run algorithm.adv_estimator = remax (its greedy baseline is "
                     "one turn); use grpo, rloo or gae")
        return p

    def workers(self, cpus_per_task: int) -> int:
        """Tool calls in flight at once: the configured count, or the rank's spare cores."""
        return self.tool_workers or min(max(cpus_per_task - 1, 1), MAX_TOOL_WORKERS)


@dataclass
class SandboxConfig(Section):
    mode: str = opt("auto", "auto: the strongest the node allows (bwrap, then namespaces, then rlimits) | "
                            "bwrap | namespaces (unshare: no network, own file view) | rlimits (limits only)",
                    choices=SANDBOX_MODES)
    cpu_time_s: float = opt(5.0, "CPU seconds of one run of model-written code, all its processes together",
                            check=">0")
    wall_time_s: float = opt(10.0, "wall seconds of one run (a sleeping program uses no CPU)", check=">0")
    memory_mb: int = opt(512, "memory of one run, MiB: each process's address space and, where a memory cgroup "
                              "can be made, the run's memory as a whole, shared memory included", check=">0")
    max_processes: int = opt(16, "processes the code may run at once", check=">0")
    max_open_files: int = opt(64, "files the code's process may hold open (each memfd or tmpfs file holds up to "
                                  "max_file_bytes of memory)", check=">0")
    max_output_bytes: int = opt(16384, "stdout + stderr kept; a program printing more is stopped", check=">0")
    max_file_bytes: int = opt(1048576, "largest file the code may write in its scratch folder", check=">0")
    scratch_root: str = opt("", "where each run's private scratch folder is made; '' = $TMPDIR or /tmp "
                                "(node-local on most clusters)")
    python: str = opt("", "interpreter model code runs under; '' = the job's base Python (its standard library "
                          "is what is promised); on a root rank in rlimits mode it must be readable by any user")
    uid_base: int = opt(DEFAULT_UID_BASE, "on a root rank each run's code gets its own unprivileged uid and gid "
                                          f"from [uid_base, uid_base + {UID_SPAN}): a range no account or id "
                                          "mapping (LDAP, SSSD) of the node uses")
    allow_limits_only: bool = opt(False, "let mode auto fall back to rlimits (limits only: the code reads what "
                                         "its uid may and reaches the network) on a rank that runs as root")

    def check(self, job) -> List[str]:
        p = []
        if self.cpu_time_s > WEEK_S or self.wall_time_s > WEEK_S:
            p.append(f"sandbox time limits are capped at one week ({WEEK_S} s)")
        if self.memory_mb > 2**24:
            p.append(f"sandbox.memory_mb = {self.memory_mb} is past 16 TiB: a unit mix-up?")
        if self.max_open_files > 1 << 20:
            p.append(f"sandbox.max_open_files = {self.max_open_files}: at most {1 << 20} (the kernel's nr_open)")
        if not 65536 <= self.uid_base <= 2**32 - 2 - UID_SPAN:
            p.append(f"sandbox.uid_base = {self.uid_base}: expected 65536 to {2**32 - 2 - UID_SPAN} (uids below "
                     f"65536 belong to the system and its accounts; {UID_SPAN} of them are taken from it)")
        return p
