"""The batch script's supervisor: srun again inside the same allocation when a rank dies.

    python3 <checkout>/verl_hpc/launcher/restart_loop.py --max-restarts M --spare-nodes S --nodes N \\
        --tasks-per-node T --backoff-s B --run-dir LOGS/%j --requeue \\
        -- srun --mpi=pmix --kill-on-bad-exit=1 ... python -m verl_hpc.job ...

The batch script (the submitter's, `--sbatch-script`'s, launch/*.sbatch) runs this in place of the
bare srun, on the batch host, with whatever python3 is there (standard library only, >= 3.8; run
by its path, not `-m`, so the ranks' packages need not be installed there). Each launch:
- srun gets VERL_HPC_ATTEMPT (0, 1, ...) and a heartbeat folder of its own; with spare
  nodes, the layout's nodes and tasks (`--nodes --ntasks --ntasks-per-node`: the allocation has
  more) and `--exclude` of the nodes left out (the batch host while it is a spare); a relaunch
  also `--overlap`: a step whose node died stays registered until Slurm declares the node down
  (SlurmdTimeout, 300 s by default), holding the live nodes' CPUs, and a new step would wait;
- its stderr passes through to the batch log and is read for srun's own report of each task that
  ended (`srun: error: node2: task 3: Segmentation fault`, a node failure, a launch that failed);
  a node where ranks died or went silent is asked to run a one-task step (one that does not is lost);
- a rank whose heartbeat stops for its trainer.heartbeat_timeout_s (each beat carries it:
  launcher/heartbeat.py) ends the step (srun sent SIGINT twice, its abort; SIGKILL 10 s later if a
  dead node keeps it waiting) and counts as dead.
Then launcher/restarts.py decides: relaunch from `latest` after a back-off (one line), stop
(exit 34 once the restarts are spent, srun's own code for an error a relaunch would replay), or
requeue the job when a lost node leaves too few (`scontrol requeue`, as Slurm would on a node failure).
A signal to this process (scancel, a preemption, the time limit, a requeue: Slurm signals every
process of the job) means the job is being stopped: srun got it too, the ranks checkpoint, and no
relaunch follows. Each verdict is appended to `<run-dir>/restarts.jsonl`, which the submitter reads.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional

if __package__ in (None, ""):  # run by path on the batch host: the checkout is two folders up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from verl_hpc.launcher import heartbeat  # noqa: E402
from verl_hpc.launcher.restarts import ATTEMPT_ENV, TAG, Death, Ledger, from_srun  # noqa: E402

RECORD = "restarts.jsonl"
ABORT_GRACE_S = 10.0  # after srun's abort, before SIGKILL: what a dead node's step may keep it waiting
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP)
_LOST_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWER")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="restart_loop.py", description=__doc__.splitlines()[0])
    p.add_argument("--max-restarts", type=int, required=True)
    p.add_argument("--spare-nodes", type=int, required=True)
    p.add_argument("--nodes", type=int, default=0, help="nodes of the layout (0: the allocation's less the spares)")
    p.add_argument("--tasks-per-node", type=int, default=0, help="0: SLURM_NTASKS_PER_NODE")
    p.add_argument("--backoff-s", type=float, required=True)
    p.add_argument("--run-dir", required=True, help="heartbeats and restarts.jsonl; %%j: the job id")
    p.add_argument("--requeue", action="store_true", help="requeue when a lost node leaves too few (slurm.requeue)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ...")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("the srun command line after --")
    return args


class Stops:
    """Signals to the supervisor: recorded (the job is being stopped), never acted on here."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        for s in STOP_SIGNALS:
            signal.signal(s, self._record)

    def _record(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        if self.signum is None:
            self.signum = signum


def scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              universal_newlines=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):  # not on a Slurm node (tests), or Slurm not answering
        return ""


def allocation_nodes(job: str) -> List[str]:
    """The job's nodes now (a node Slurm lost leaves the allocation of a --no-kill job once down)."""
    if not job:
        return []
    fields = dict(w.split("=", 1) for w in scontrol("show", "job", "-o", job).split() if "=" in w)
    nodelist = fields.get("NodeList") or os.environ.get("SLURM_JOB_NODELIST", "")
    return scontrol("show", "hostnames", nodelist).split() if nodelist and nodelist != "(null)" else []


def lost_nodes(nodes: List[str]) -> List[str]:
    """The nodes among `nodes` Slurm reports down, draining, failed or not responding."""
    out = []
    for line in scontrol("show", "node", "-o", ",".join(nodes)).splitlines() if nodes else []:
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if any(s in fields.get("State", "") for s in _LOST_STATES):
            out.append(fields.get("NodeName", ""))
    return out


def latest_step(checkpoint_dir: str) -> Optional[int]:
    """The step `latest` names (checkpoint/publish.py writes `step_<N>`), None without one."""
    try:
        with open(os.path.join(checkpoint_dir, "latest")) as f:
            name = f.read().strip()
        return int(name.rsplit("_", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def answers(node: str) -> bool:
    """Whether `node` runs a one-task step now. A node whose ranks died or went silent may be gone
    while Slurm still lists it (it notices after SlurmdTimeout, 300 s by default): a relaunch there
    would fail and spend a restart."""
    try:
        return subprocess.run(["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=" + node, "true"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def gone(nodes: List[str]) -> List[str]:
    """The nodes among `nodes` that do not answer (asked at once, each on a thread)."""
    answered = {}
    threads = [threading.Thread(target=lambda n=n: answered.__setitem__(n, answers(n))) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [n for n in nodes if not answered.get(n)]


def srun_argv(command: List[str], *, spare_nodes: int, nodes: int, tasks_per_node: int, exclude: List[str],
              relaunch: bool) -> List[str]:
    """The srun line with what this launch adds after `srun`: the layout where the allocation has
    spares, the nodes left out, --overlap on a relaunch."""
    added = []
    if spare_nodes > 0 and nodes > 0 and tasks_per_node > 0:
        added += ["--nodes=%d" % nodes, "--ntasks=%d" % (nodes * tasks_per_node), "--ntasks-per-node=%d" % tasks_per_node]
    if exclude:
        added.append("--exclude=" + ",".join(exclude))
    if relaunch:  # and the first launch's logs kept: srun truncates its --output files by default
        added += ["--overlap", "--open-mode=append"]
    return [command[0], *added, *command[1:]]


class Launch:
    """One srun: its stderr passed through and kept, its ranks' heartbeats watched."""

    def __init__(self, argv: List[str], env: dict, watch: heartbeat.Watch):
        self.silent: List[Death] = []
        self.text: List[str] = []
        self.proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, universal_newlines=True,
                                     errors="replace", bufsize=1)  # OSError (no srun): main's one line
        self._reader = threading.Thread(target=self._copy, daemon=True)
        self._reader.start()
        self.watch = watch

    def _copy(self) -> None:
        for line in self.proc.stderr:
            self.text.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def wait(self) -> int:
        while True:
            try:
                rc = self.proc.wait(timeout=self.watch.poll_s())
                break
            except subprocess.TimeoutExpired:
                pass
            if not self.silent:
                quiet = self.watch.silent()
                if quiet:
                    self._end(quiet)
        self._reader.join(timeout=30)
        return 128 - rc if rc < 0 else rc  # killed by a signal: the shell's code for it, as the script had

    def _end(self, quiet) -> None:
        """Silent ranks: counted dead, and the step ended (srun's abort, then SIGKILL)."""
        for rank, beat, seconds in quiet:
            self.silent.append(Death(rank, beat.host, "no heartbeat for %.0f s" % seconds, True,
                                     beat.step or None))
        ranks = ", ".join(str(d.rank) for d in self.silent)
        print("%s rank(s) %s: no heartbeat for %.0f s (holding the GIL, stopped, or on a node that is gone): "
              "ending the job step" % (TAG, ranks, max(q[2] for q in quiet)), flush=True)
        for _ in range(2):  # two SIGINTs within a second: srun's abort (SIGKILL to every task)
            self.proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        try:
            self.proc.wait(timeout=ABORT_GRACE_S)
        except subprocess.TimeoutExpired:  # a task on a dead node never reports: leave the step behind
            self.proc.kill()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stops = Stops()
    job = os.environ.get("SLURM_JOB_ID", "")
    run_dir = os.path.abspath(args.run_dir.replace("%j", job or "local"))  # the ranks' cwd may differ (containers)
    # the layout: what the script says, else the allocation's shape less the spares
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "0")
    tasks_per_node = args.tasks_per_node or int(per_node.split("(")[0].split(",")[0] or 0)
    nodes = allocation_nodes(job)
    total = len(nodes) or int(os.environ.get("SLURM_JOB_NUM_NODES", "0") or 0)
    needed = args.nodes or max(1, total - args.spare_nodes)
    ledger = Ledger(args.max_restarts, args.spare_nodes, args.backoff_s, args.requeue,
                    batch_host=os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    exclude = ledger.first_exclude(nodes, needed) if args.spare_nodes else []
    attempt = 0
    while True:
        beats = os.path.join(run_dir, "heartbeats", "launch%d" % attempt)
        os.makedirs(beats, exist_ok=True)
        env = dict(os.environ, **{ATTEMPT_ENV: str(attempt), heartbeat.ENV: beats})
        watch = heartbeat.Watch(beats)
        argv = srun_argv(args.command, spare_nodes=args.spare_nodes, nodes=needed, tasks_per_node=tasks_per_node,
                         exclude=exclude, relaunch=attempt > 0)
        try:
            launch = Launch(argv, env, watch)
        except OSError as e:
            print("%s cannot start %s: %s" % (TAG, argv[0], e), file=sys.stderr, flush=True)
            return 127
        rc = launch.wait()
        if stops.signum is not None:  # the job is being stopped (srun got the signal too): no relaunch
            return rc
        deaths, lost = from_srun("".join(launch.text))
        if rc == 0 and not launch.silent:
            if attempt:
                print("%s the job finished after %d restart(s) in this allocation" % (TAG, attempt), flush=True)
            return 0
        died_at = time.time()
        silent = {d.rank for d in launch.silent}
        deaths = launch.silent + [d._replace(step=watch.step_of(d.rank)) for d in deaths if d.rank not in silent]
        steps = [d.step for d in deaths if d.step]
        step = max(steps) if steps else watch.last_step()
        nodes = allocation_nodes(job)
        lost += [n for n in lost_nodes(sorted(set(nodes) | {d.node for d in deaths if d.node})) if n not in lost]
        if job:  # the nodes where ranks died: asked directly whether they are there
            lost += gone(sorted({d.node for d in deaths if d.restartable and d.node in nodes and d.node not in lost}))
        verdict = ledger.decide(deaths, lost, nodes, needed, step, rc or 1)
        if verdict.action == "restart":
            end = time.time() + verdict.wait_s
            while time.time() < end and stops.signum is None:  # the back-off, cut short by a stop
                time.sleep(min(0.5, max(0.0, end - time.time())))
            if stops.signum is not None:
                return rc
        checkpoints = heartbeat.job_facts(beats).get("checkpoint_dir", "")  # rank 0's word (none before it spoke)
        line = verdict.line(latest_step(checkpoints), known=bool(checkpoints))
        print(line, flush=True)
        _record(run_dir, dict(time=time.time(), launch=attempt, action=verdict.action, line=line,
                              seconds_down=round(time.time() - died_at, 1),
                              deaths=[d._asdict() for d in deaths], lost=lost, exclude=list(verdict.exclude)))
        if verdict.action == "restart":
            exclude, attempt = list(verdict.exclude), verdict.attempt
            continue
        if verdict.action == "requeue":
            done = subprocess.run(["scontrol", "requeue", job], stderr=subprocess.PIPE, universal_newlines=True)
            if done.returncode != 0:
                print("%s `scontrol requeue %s` failed (%d): %s; resubmit the job to resume"
                      % (TAG, job, done.returncode, done.stderr.strip()), flush=True)
        return verdict.exit_code


def _record(run_dir: str, row: dict) -> None:
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, RECORD), "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:  # the line in the log says it; the record is the submitter's convenience
        print("%s could not append to %s: %s" % (TAG, os.path.join(run_dir, RECORD), e), flush=True)


if __name__ == "__main__":
    sys.exit(main())
