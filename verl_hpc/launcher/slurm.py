"""Submission to Slurm through submitit, then waiting with rank 0's log streamed and a verdict.

submitit writes the sbatch script, tracks the job through sacct (which is why the dev cluster runs
slurmdbd: without accounting a job that died without a result is never seen to end) and handles
the per-task log files. We add the MPI/PMIx launch, fail-fast on a dead rank, the container and
environment, and a failure message that names the rank and its log.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path

import submitit

from verl_hpc.config import ConfigError
from verl_hpc.launcher import job_script
from verl_hpc.launcher.plan import Plan, rank_label

FINISHED_OK = "COMPLETED"
ACTIVE_STATES = {"PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING",
                 "SUSPENDED", "UNKNOWN"}


def make_executor(plan: Plan, cfg) -> submitit.SlurmExecutor:
    """The allocation, srun arguments, set-up lines and rank command come from job_script, which
    the standalone script shares; submitit quotes each #SBATCH value and srun argument itself."""
    if plan.hetjob:
        raise ConfigError(
            f"placement.rollout_partition = {plan.rollout_partition!r} asks for a Slurm heterogeneous job, which "
            "submitit cannot submit (it writes one #SBATCH block per job): write the job with --sbatch-script PATH "
            "and submit that with sbatch, or set placement.rollout_partition='' to take the rollout nodes from "
            "slurm.nodes")
    workdir = os.getcwd()
    ex = Executor(folder=str(plan.log_dir), python=shlex.join(job_script.python_argv(plan, cfg, workdir)),
                  max_num_timeout=3)
    ex.supervisor, ex.ranks = job_script.supervisor_argv(plan, cfg), plan.world_size
    ex.update_parameters(**job_script.sbatch_parameters(plan, cfg), srun_args=job_script.srun_args(cfg),
                         setup=job_script.setup_lines(plan, cfg, workdir), use_srun=not ex.supervisor)
    return ex


class Executor(submitit.SlurmExecutor):
    """submitit's executor with the restart supervisor (launcher/restart_loop.py) in front of its
    srun line: submitit writes `srun ... python -u -m submitit.core._submit FOLDER` itself, so with
    the supervisor on its own srun is turned off (`use_srun=False`) and the same srun line, with
    submitit's log options, comes after the supervisor's `--` here. The job's tasks are its ranks:
    the spare nodes' share of the allocation runs none."""

    supervisor: list = []
    ranks = 0

    @property
    def _submitit_command_str(self) -> str:
        command = super()._submitit_command_str
        if not self.supervisor:
            return command
        paths = submitit.core.utils.JobPaths(folder=self.folder)
        srun = ["srun", "--unbuffered", "--output", str(paths.stdout), "--error", str(paths.stderr),
                *self.parameters.get("srun_args", [])]
        return shlex.join(self.supervisor + srun) + " " + command

    def _num_tasks(self) -> int:
        return self.ranks or super()._num_tasks()


def sbatch_text(ex: submitit.SlurmExecutor) -> str:
    """The exact script submitit would submit (for --dry-run). submitit has no public call for it;
    tests/unit/test_submit.py fails loudly if this private one changes."""
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def submit(ex: submitit.SlurmExecutor, fn, *args) -> submitit.Job:
    return ex.submit(fn, *args)


class MetricsProgress:
    """`step 12/200 (6%) 3.4 s/step ETA 10m38s` from the trainer's metrics.jsonl, which rank 0
    appends to once per step on the shared file system: the submitter needs no channel of its own
    to the job, and the line does not depend on which tracking backends print to the log. The
    rate is over the last steps' own timestamps (tracking/progress.py's rule)."""

    def __init__(self, metrics_file: Path, total_steps: int) -> None:
        self.path, self.total = Path(metrics_file), int(total_steps)
        self._offset, self._seen = 0, []  # (step, time) of the rows read so far
        self._pool = None  # (pool size, joins) of the newest row of an elastic run

    def __call__(self) -> str:
        import json

        from verl_hpc.tracking.progress import WINDOW, format_duration, format_rate

        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self._offset:  # a resumed attempt rewrote the file
                    self._offset, self._seen = 0, []
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return ""
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self._offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
                step, t = int(row["step"]), float(row["time"])
            except (ValueError, KeyError, TypeError):
                continue
            self._seen = [(s, x) for s, x in self._seen if s < step] + [(step, t)]
            if "elastic/pool_size" in row:  # placement.elastic: the joined workers, and who has joined so far
                self._pool = (int(row["elastic/pool_size"]), int(row.get("elastic/joins", 0)))
        if not self._seen:
            return ""
        window = self._seen[-(WINDOW + 1):]
        (s0, t0), (s1, t1) = window[0], window[-1]
        rate = (t1 - t0) / (s1 - s0) if s1 > s0 else float("nan")
        pct = 100.0 * s1 / self.total if self.total > 0 else 0.0
        pool = f"; rollout pool {self._pool[0]} worker(s) ({self._pool[1]} joined so far)" if self._pool else ""
        return (f"step {s1}/{self.total} ({pct:.0f}%) {format_rate(rate)} "
                f"ETA {format_duration(rate * max(self.total - s1, 0))}{pool}")


def wait(job: submitit.Job, *, poll_s: float = 2.0, status_every_s: float = 15.0, progress=None,
         rollout_ranks: int = 0) -> int:
    """Stream rank 0's stdout, print a status line now and then (with `progress()`'s step line
    when it has one); 0 if COMPLETED, else 1, after naming each failed rank (with its group in a
    split job: its first `rollout_ranks` ranks roll out)."""
    out_path = Path(job.paths.stdout)
    offset, t0, last_status = 0, time.time(), 0.0
    print(f"[submit] job {job.job_id} submitted; logs: {job.paths.folder}", flush=True)
    while True:
        # a failed launch's rank 0 leaves submitit's result file while the restart supervisor
        # relaunches the ranks in the same allocation: done is what Slurm says (launcher/restart_loop.py)
        done = job.done() and _ended(job)
        offset = _stream(out_path, offset)
        now = time.time()
        if done:
            break
        if now - last_status >= status_every_s:
            steps = progress() if progress is not None else ""
            print(f"[submit] job {job.job_id} {job.state} {time.strftime('%M:%S', time.gmtime(now - t0))}"
                  " elapsed" + (f"; {steps}" if steps else ""), flush=True)
            last_status = now
        time.sleep(poll_s)
    _stream(out_path, offset)
    state = final_state(job)
    again = restarts_words(Path(job.paths.folder))
    if state.startswith(FINISHED_OK):
        print(f"[submit] job {job.job_id} {state} in {now - t0:.0f}s{again}; logs: {job.paths.folder}")
        return 0
    print(f"[submit] job {job.job_id} ended {state}{again}", file=sys.stderr)
    for rank, reason, node, log in failed_ranks(job):
        where = f" (node {node})" if node else ""
        print(f"[submit]   {rank_label(rank, rollout_ranks)}: {reason}{where}; log: {log}", file=sys.stderr)
    print(f"[submit] all logs: {job.paths.folder}", file=sys.stderr)
    return 1


def _ended(job: submitit.Job) -> bool:
    """Whether Slurm says the job is over (asked only once submitit thinks so)."""
    return job.get_info(mode="force").get("State", "UNKNOWN").split()[0] not in ACTIVE_STATES - {"UNKNOWN"}


def restarts_words(folder: Path) -> str:
    """` after 1 in-allocation restart (the [restart] lines above)` from the supervisor's record."""
    import json

    try:
        rows = [json.loads(line) for line in (folder / "restarts.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return ""
    n = sum(1 for r in rows if r.get("action") == "restart")
    return f" after {n} in-allocation restart(s) (the [restart] lines above)" if n else ""


def final_state(job: submitit.Job, timeout_s: float = 60.0) -> str:
    """The job's state from sacct once Slurm has finished it. submitit calls a job done as soon as
    its result file exists, while sacct may still say RUNNING or COMPLETING for a few seconds."""
    end = time.time() + timeout_s
    while True:
        state = job.get_info(mode="force").get("State", "UNKNOWN")
        if state.split()[0] not in ACTIVE_STATES or time.time() > end:
            return state
        time.sleep(1.0)


def _stream(path: Path, offset: int) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    if offset and not chunk and path.stat().st_size < offset:  # a requeued attempt began a new log
        return 0
    if chunk:
        sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()
    return offset + len(chunk)


_SRUN_TASK = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)")


def failed_ranks(job: submitit.Job) -> list[tuple[int, str, str, Path]]:
    """(rank, why, node, log) of the ranks that failed, from srun's own report in the batch log (it
    names each task that exited non-zero and its node); falls back to the task logs with a
    traceback when srun said nothing. The node matters on a multi-node job: a whole node dying
    shows up as its ranks killed and the other nodes' ranks failing in a collective."""
    folder = Path(job.paths.folder)
    batch_err = Path(str(job.paths.stderr))
    found: dict[int, tuple[str, str]] = {}
    text = batch_err.read_text(errors="replace") if batch_err.exists() else ""
    for m in _SRUN_TASK.finditer(text):
        for rank in _expand(m.group(2)):
            found.setdefault(rank, (m.group(3).strip(), m.group(1)))
    if not found:
        for log in sorted(folder.glob(f"{job.job_id}_*_log.err")):
            if "Traceback" in log.read_text(errors="replace"):
                found[int(log.name.split("_")[1])] = ("raised an exception", _host_of(log))
    out = []
    for r, (why, node) in sorted(found.items()):
        log = folder / f"{job.job_id}_{r}_log.err"
        out.append((r, error_line(log) or why, node, log))
    return out


def _host_of(log: Path) -> str:
    """The host a rank ran on, from the runtime's `rank R/W up via ... on host H` line."""
    m = re.search(r" up via \S+ on host (\S+)", log.read_text(errors="replace"))
    return m.group(1) if m else ""


def error_line(log: Path) -> str:
    """The rank's own one-line `error: ...` (verl_hpc/runtime/errors.py), if it printed one."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else ""


def _expand(spec: str) -> list[int]:
    ranks = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        ranks += range(int(lo), int(hi or lo) + 1)
    return ranks
