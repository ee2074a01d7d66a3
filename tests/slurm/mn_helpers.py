"""Shared pieces of the multi-node tests: the 2-node check, tiny GRPO jobs submitted through the
user's two entry points (`python -m verl_hpc.submit` and `sbatch launch/dev/grpo_2x2_cpu.sbatch`),
and reading what the ranks logged about themselves."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
from jobs import MOVING, TINY_GRPO, data_overrides

USABLE = ("idle", "mixed", "allocated", "completing")
# 4 ranks: each gets 2 x 4 / 2 DP ranks = 4 sequences per optimizer step
LAYOUT = ["parallel.tp=2", "actor.micro_batch_size=4"]
RANK_UP = re.compile(r"rank (\d+)/(\d+) up via srun on host (\S+) \(local (\d+), node (\d+)\).*"
                     r"master (\S+):(\d+)")


def usable_nodes() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                         timeout=30).stdout.split("\n")
    return sorted({ln.split()[0] for ln in out if ln.strip() and ln.split()[1] in USABLE})


def assert_two_nodes(timeout: float = 120):
    """Two usable nodes, waiting up to `timeout` for a node that a test before this one just left
    (its last job still completing, or being cleaned up after a scancel)."""
    end = time.time() + timeout
    while len(usable_nodes()) < 2 and time.time() < end:
        time.sleep(1)
    nodes = usable_nodes()
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], capture_output=True, text=True,
                            timeout=30).stdout.strip().replace("\n", "; ")
    assert len(nodes) >= 2, (f"the multi-node tests need a dev cluster of 2 nodes, {nodes} usable after "
                             f"{timeout:.0f}s (sinfo: {states}): run `slurm/devcluster/start.sh --nodes 2` "
                             "(`make cluster` does)")


def job_args(root: Path, out: Path, *extra) -> list[str]:
    return [f"model.path={root}/model", *data_overrides(root), *TINY_GRPO, *MOVING, *LAYOUT,
            f"trainer.output_dir={out}", *extra]


def submit_grpo(root: Path, out: Path, nodes: int, tasks_per_node: int, *extra, no_wait=False):
    """`python -m verl_hpc.submit` (submitit); returns the running Popen."""
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", *job_args(root, out, *extra),
           f"slurm.nodes={nodes}", f"slurm.tasks_per_node={tasks_per_node}", "slurm.cpus_per_task=1",
           "slurm.time_min=15", f"slurm.log_dir={out}/logs/%j", *(["--no-wait"] if no_wait else [])]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sbatch_grpo(root: Path, out: Path, nodes: int, tasks_per_node: int, *extra, wait=True):
    """`sbatch launch/dev/grpo_2x2_cpu.sbatch` with this venv's python on PATH."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               RUN_DIR=f"{out}/run-%j")  # the restart supervisor's folder: not the checkout's logs/
    cmd = ["sbatch", *(["--wait"] if wait else ["--parsable"]), f"--nodes={nodes}",
           f"--ntasks-per-node={tasks_per_node}", f"--output={out}/sbatch-%j.out",
           "launch/dev/grpo_2x2_cpu.sbatch", *job_args(root, out, *extra)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc, out: Path, timeout=600) -> tuple[int, str]:
    try:
        o, e = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        o, e = proc.communicate()
    return proc.returncode, o + e + all_logs(out)


def all_logs(out: Path, tail: int = 6000) -> str:
    """The batch log (sbatch) or every rank's logs (submitit), each cut to its last `tail` chars."""
    files = sorted(list(out.glob("sbatch-*.out")) + list(out.glob("logs/**/*_log.*")))
    return "".join(f"\n--- {f}\n{f.read_text(errors='replace')[-tail:]}" for f in files if f.is_file())


def rank_lines(text: str) -> dict[int, dict]:
    """What each rank said about itself in its `rank R/W up via srun on host H ...` line."""
    ranks = {}
    for m in RANK_UP.finditer(text):
        ranks[int(m.group(1))] = dict(world=int(m.group(2)), host=m.group(3), local=int(m.group(4)),
                                      node=int(m.group(5)), master=m.group(6), port=int(m.group(7)))
    return ranks


def squeue_ids(name_part: str = "") -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=30).stdout
    return [ln.split()[0] for ln in out.splitlines() if name_part in ln]


def wait_for(pred, timeout: float, what: str, poll=0.5):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
