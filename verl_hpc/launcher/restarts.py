"""In-allocation restart: a rank that dies ends the job step, not the job (docs/resilience.md).

    ledger = Ledger(cfg.slurm.max_restarts, cfg.slurm.spare_nodes, cfg.slurm.restart_backoff_s, cfg.slurm.requeue)
    deaths = from_srun(srun_stderr) or [from_exit(rank, code)]        # who ended the launch, and how
    verdict = ledger.decide(deaths, lost_nodes=..., nodes=[...], needed=2, step=41)
    verdict.action: restart | stop | requeue;  verdict.exclude;  verdict.wait_s
    print(verdict.line(resume_step=40))  # [restart] rank 3 on node n2 died (SIGSEGV) at step 41; restarted from step 40 (1 of 2)

One set of rules for both supervisors, the Slurm batch script's (launcher/restart_loop.py) and the
local submitter's (launcher/local_restarts.py).

What counts as a death, which is restarted from the latest checkpoint: a rank killed by a signal
(SIGKILL: the OOM killer, a node's ranks gone; SIGSEGV, SIGBUS, SIGABRT: a crash in C), a rank
its stage watchdog ended (exit 16: stuck outside collectives), a rank whose heartbeat stopped (the
supervisor killed it: launcher/heartbeat.py), a node Slurm lost. What does not: a rank that ended
with an error it reported (a config, data, reward or checkpoint error, its class's exit code; an
uncaught exception, 1; a collective that timed out on every rank with no rank dead or silent):
a relaunch from the same checkpoint replays the same step and meets the same error, so the job
fails as before, naming the rank. SIGTERM, SIGINT and SIGUSR2 are stops someone asked for (a
cancel, a preemption, Slurm's warning signal: docs/signals.md), never faults.

Nodes: a node whose ranks died in two launches, or one Slurm reports lost (its slurmd does not
answer a launch, a node failure, DOWN/DRAIN/NOT_RESPONDING), is left out (`srun --exclude`) where
the allocation has a node to spare (`slurm.spare_nodes`). A node that died twice but is all there
is stays in. A lost node without a spare: the layout no longer fits, and the job is requeued
(`slurm.requeue`, as Slurm would requeue it on a node failure) or stops with one line.

Standard library only (Python >= 3.8): the batch script runs the Slurm supervisor with the batch
host's python3, which may not be the ranks' (a container's).
"""
import collections
import re
import signal
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence

ATTEMPT_ENV = "VERL_HPC_ATTEMPT"  # runtime/faults.py's ATTEMPT_ENV (a unit test keeps them equal)
STALL_EXIT = 16  # runtime/watchdog.py's EXIT_CODE (a unit test keeps them equal)
SPENT_EXIT = 34  # the supervisor's exit code once slurm.max_restarts is spent (docs/errors.md)
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP)  # asked for, not faults
TAG = "[restart]"


class Death(NamedTuple):
    rank: int
    node: str  # "" for a local rank
    how: str  # "SIGSEGV", "exit code 16: stalled", "no heartbeat for 31 s", "exit code 2"
    restartable: bool
    step: Optional[int] = None  # the step it was in (its heartbeat), where known


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return "signal %d" % number


def from_exit(rank: int, code: int, node: str = "") -> Death:
    """A rank's end from its exit code: negative (Python's subprocess: killed by that signal) or
    128 + n (a shell's word for the same) is a signal; 16 the stage watchdog; anything else an
    error the rank reported."""
    number = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else 0
    if number:
        return Death(rank, node, signal_name(number), number not in STOPS)
    if code == STALL_EXIT:
        return Death(rank, node, "exit code 16: stalled outside collectives", True)
    return Death(rank, node, "exit code %d" % code, False)


# srun's words for a task's end: strsignal()'s text ("Segmentation fault", "Killed") or an exit code
_SIGNAL_WORDS = sorted(((signal.strsignal(s) or "", int(s)) for s in signal.valid_signals()
                        if signal.strsignal(s)), key=lambda x: -len(x[0]))
_TASK = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
_LAUNCH_FAILED = re.compile(r"^srun: error: Task launch for \S+ failed on node (\S+): (.+)$")
_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)")
_TERMINATING = ("_step_signal: Terminating StepId", "Job step aborted", "STEP", "Force Terminated")


def from_srun(text: str):
    """(the deaths that ended the step, the nodes Slurm lost) from srun's stderr. srun names each
    task that ended badly as it learns of it; --kill-on-bad-exit then terminates the step
    (`_step_signal: Terminating StepId=...`) and the others follow as `Terminated` or `Killed`:
    only the lines before that are the cause."""
    deaths: List[Death] = []
    lost: List[str] = []
    cut = False
    for line in text.splitlines():
        m = _NODE_FAILURE.match(line) or _LAUNCH_FAILED.match(line)
        if m:
            if m.group(1) not in lost:
                lost.append(m.group(1))
            continue
        if not line.startswith("srun: error:") and any(w in line for w in _TERMINATING):
            cut = cut or bool(deaths or lost)  # the step's end after the first death or lost node
            continue
        m = _TASK.match(line)
        if m and not cut:
            node, why = m.group(1), m.group(3).strip()
            for rank in _ranks(m.group(2)):
                deaths.append(_task_end(rank, node, why))
    return deaths, lost


def _task_end(rank: int, node: str, why: str) -> Death:
    m = re.match(r"Exited with exit code (\d+)", why)
    if m:
        return from_exit(rank, int(m.group(1)), node)
    for words, number in _SIGNAL_WORDS:
        if why.startswith(words):
            return from_exit(rank, -number, node)
    return Death(rank, node, why, False)


def _ranks(spec: str) -> List[int]:
    out: List[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


class Verdict(NamedTuple):
    action: str  # restart | stop | requeue
    what: str  # who died how, at which step (the line's first half)
    attempt: int  # the launch this verdict starts (restart), or the last one
    max_restarts: int
    exclude: Sequence[str] = ()
    left_out: str = ""  # the words on nodes left out now
    wait_s: float = 0.0
    why_not: str = ""  # stop / requeue: why not restarted
    exit_code: int = 0

    def line(self, resume_step: Optional[int], known: bool = True) -> str:
        """The one line for this verdict; resume_step: the checkpoint `latest` names (None: none;
        known=False: the supervisor was not told where the checkpoints are)."""
        at = ("from step %d" % resume_step if resume_step else "from the start (no checkpoint yet)" if known
              else "from the latest checkpoint")
        if self.action == "restart":
            return "%s %s;%s restarted %s (%d of %d)" % (TAG, self.what, self.left_out, at, self.attempt,
                                                        self.max_restarts)
        kept = ("; the job ends with its checkpoint of step %d" % resume_step if resume_step
                else "; the job ends without a checkpoint" if known else "; the job ends with its latest checkpoint")
        if self.action == "requeue":
            kept = "; requeued: it resumes %s on a new allocation" % at
        return "%s %s; not restarted: %s%s" % (TAG, self.what, self.why_not, kept)


def describe(deaths: Sequence[Death], lost: Sequence[str], step: Optional[int]) -> str:
    """`rank 3 on node n2 died (SIGSEGV) at step 41`, several ranks grouped by node and cause."""
    groups: Dict[tuple, List[int]] = collections.OrderedDict()
    for d in deaths:
        groups.setdefault((d.node, d.how, d.restartable), []).append(d.rank)
    parts = []
    for (node, how, restartable), ranks in groups.items():
        who = ("rank %d" % ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
        where = " on node %s" % node if node else ""
        verb = "died" if restartable else "failed"
        if how.startswith("no heartbeat"):
            verb = "stopped"
        parts.append("%s%s %s (%s)" % (who, where, verb, how))
    parts += ["node %s lost" % n for n in lost if not any(d.node == n for d in deaths)]
    text = "; ".join(parts) or "the job step ended without a rank's word"
    return text + (" at step %d" % step if step else "")


class Ledger:
    """The restarts of one allocation (or one local job): the budget, the nodes whose ranks died."""

    def __init__(self, max_restarts: int, spare_nodes: int = 0, backoff_s: float = 10.0, requeue: bool = False,
                 batch_host: str = ""):
        self.max_restarts, self.spare_nodes = int(max_restarts), int(spare_nodes)
        self.backoff_s, self.requeue = float(backoff_s), bool(requeue)
        self.restarts = 0  # launches after the first, so far
        self.died_on: Dict[str, int] = collections.Counter()  # node -> launches in which its ranks died
        self.lost: set = set()  # nodes Slurm lost: never used again
        self.excluded: List[str] = []  # the nodes the last verdict left out
        self._said: set = set()  # nodes a line has said are left out
        # with a spare node the batch host is the first spare: it runs the batch script, this
        # supervisor and srun, and a fault elsewhere moves the ranks onto it
        self.batch_host = batch_host

    def first_exclude(self, nodes: Sequence[str], needed: int) -> List[str]:
        """The nodes the first launch leaves out: the batch host where the allocation has a spare."""
        if self.batch_host in nodes and len(nodes) - 1 >= needed:
            return [self.batch_host]
        return []

    def decide(self, deaths: Sequence[Death], lost_nodes: Iterable[str] = (), nodes: Sequence[str] = (),
               needed: int = 0, step: Optional[int] = None, exit_code: int = 1) -> Verdict:
        """What to do after a launch ended badly. nodes: the allocation's nodes now (Slurm; empty
        locally); needed: the nodes a launch takes; exit_code: the launch's, for a stop."""
        lost = [n for n in lost_nodes if n]
        dead = [d for d in deaths if d.restartable]
        what = describe(dead or deaths, lost, step)  # a death's collateral (a peer's error) is not news
        base = dict(what=what, max_restarts=self.max_restarts)
        if not dead and not lost:
            return Verdict("stop", attempt=self.restarts, exit_code=exit_code or 1,
                           why_not="an error the rank reported, which a relaunch from the checkpoint would "
                                   "meet again", **base)
        self.lost.update(lost)
        if nodes and len([n for n in nodes if n not in self.lost]) < needed:
            # what a node failure did before restarts existed: Slurm's requeue, whatever the budget
            why = ("node(s) %s lost and %d node(s) left, the layout takes %d (slurm.spare_nodes = %d)"
                   % (", ".join(sorted(self.lost)), len(set(nodes) - self.lost), needed, self.spare_nodes))
            return Verdict("requeue" if self.requeue else "stop", attempt=self.restarts, why_not=why,
                           exit_code=exit_code or 1, **base)
        if self.restarts >= self.max_restarts:
            return Verdict("stop", attempt=self.restarts, exit_code=SPENT_EXIT,
                           why_not="the %d restart(s) of slurm.max_restarts = %d are spent"
                                   % (self.restarts, self.max_restarts), **base)
        for node in sorted({d.node for d in dead if d.node}):
            self.died_on[node] += 1
        exclude, words = self._exclude(nodes, needed)
        self.restarts += 1
        self.excluded = exclude
        wait = min(self.backoff_s * 2 ** (self.restarts - 1), 300.0) if self.backoff_s > 0 else 0.0
        return Verdict("restart", attempt=self.restarts, exclude=tuple(exclude), left_out=words, wait_s=wait, **base)

    def _exclude(self, nodes: Sequence[str], needed: int):
        """(the nodes to leave out, the words for those left out now); `decide` has made sure the
        nodes left hold the layout. Locally (no nodes) nothing is left out."""
        if not nodes:
            return [], ""
        usable = [n for n in nodes if n not in self.lost]
        spare = len(usable) - needed
        twice = [n for n in usable if self.died_on.get(n, 0) >= 2]
        out = sorted(twice, key=lambda n: n not in self.excluded)[:spare]  # a node left out stays out
        if self.batch_host in usable and self.batch_host not in out and spare - len(out) >= 1:
            out.append(self.batch_host)  # still a spare to keep: the batch host stays out of the layout
        # a lost node stays in the allocation until Slurm declares it down: srun must not pick it
        out += [n for n in nodes if n in self.lost]
        new = [n for n in out if n not in self._said and n != self.batch_host]
        self._said.update(new)
        if not new:
            return out, ""
        reasons = ["node %s left out (%s)" % (n, "lost" if n in self.lost else "its ranks died in two launches")
                   for n in new]
        on = [n for n in usable if n not in out][:needed]
        return out, " %s; the ranks run on %s now;" % ("; ".join(reasons), ", ".join(on))
