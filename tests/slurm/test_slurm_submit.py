"""Real submissions to the single-node dev cluster (slurm/devcluster/start.sh; `make test` starts it).

These fail, never skip, when the cluster is down: a silent skip would hide the main path of the
project. Every wait is bounded so a broken cluster fails the test instead of hanging CI.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from time_budget import load_factor

REPO = Path(__file__).resolve().parents[2]
FOUR_RANKS = ["slurm.tasks_per_node=4", "slurm.gpus_per_node=4", "slurm.time_min=5"]


@pytest.fixture(scope="module", autouse=True)
def cluster_is_up():
    # one line per node (-N) and partition: usable when some node is
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and {"idle", "mixed", "allocated"} & set(r.stdout.split()), (
        f"dev cluster not usable (sinfo: {r.stdout!r} {r.stderr!r}); run slurm/devcluster/start.sh")


def submit(tmp_path, *args, timeout=240):
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/smoke.yaml",
           f"trainer.output_dir={tmp_path}/out", f"slurm.log_dir={tmp_path}/logs/%j", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def check_four_ranks_agree(result):
    assert result["world_size"] == 4 and result["ok"]
    ranks = sorted(result["ranks"], key=lambda x: x["rank"])
    assert [x["rank"] for x in ranks] == [0, 1, 2, 3]
    for x in ranks:  # launcher, torch.distributed and MPI all say the same
        assert x["launcher"] == "srun" and (x["torch_rank"], x["torch_world"]) == (x["rank"], 4)
        assert (x["mpi_rank"], x["mpi_size"]) == (x["rank"], 4), x
    assert len({x["job_id"] for x in ranks}) == 1


def test_submit_four_ranks_through_submitit(tmp_path):
    r = submit(tmp_path, *FOUR_RANKS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "COMPLETED" in r.stdout and "SMOKE_RESULT" in r.stdout  # rank 0's log was streamed
    check_four_ranks_agree(json.loads((tmp_path / "out" / "smoke_result.json").read_text()))


def test_same_job_through_plain_sbatch(tmp_path):
    script = tmp_path / "job.sbatch"
    r = submit(tmp_path, *FOUR_RANKS, "--sbatch-script", str(script))
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    assert "srun --mpi=pmix --kill-on-bad-exit=1" in text and "#SBATCH --ntasks-per-node=4" in text
    done = subprocess.run(["sbatch", "--wait", str(script)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr + _logs(tmp_path / "logs")
    check_four_ranks_agree(json.loads((tmp_path / "out" / "smoke_result.json").read_text()))


def test_dead_rank_fails_job_fast_and_names_log(tmp_path, smoke_job, failure_after):
    load_at_start = os.getloadavg()[0]
    proc = smoke_job(tmp_path, *FOUR_RANKS, "trainer.smoke.steps=500", "trainer.smoke.fail_rank=1",
                     "trainer.smoke.fail_at_step=2", local=False)
    out, err, elapsed = failure_after(proc, tmp_path / "logs", "*/*_1_log.err", "dies on purpose")
    assert proc.returncode != 0, out
    # 60 s on a quiet machine (the smoke config's collective timeout: the latest a rank may notice),
    # stretched like the time budgets by the load beyond the suite's own (76 s seen at load 10)
    limit = 60 * load_factor([load_at_start, os.getloadavg()[0]])
    assert elapsed < limit, f"the job took {elapsed:.0f}s to fail after rank 1 died (limit {limit:.0f} s)"
    assert "ended FAILED" in err, err
    m = re.search(r"rank 1: (.*); log: (\S+)", err)
    assert m, err
    assert "exit code 3" in m.group(1)
    assert Path(m.group(2)).exists() and "dies on purpose" in Path(m.group(2)).read_text()


@pytest.mark.long  # a third 4-rank Slurm job (make test-long); make test covers the warning flag on
# every rank with local ranks (tests/dist/test_local_launch.py, USR2 and TERM) and Slurm's --signal
# option in the submitter's script (tests/unit/test_submit.py)
def test_warning_signal_sets_flag_on_all_ranks(tmp_path):
    r = submit(tmp_path, *FOUR_RANKS, "trainer.smoke.steps=600", "trainer.smoke.step_seconds=0.1",
               "--no-wait")
    assert r.returncode == 0, r.stderr
    job_id = re.search(r"job (\d+) submitted", r.stdout).group(1)
    log = next_log(tmp_path / "logs" / job_id, f"{job_id}_0_log.err", "smoke step 3/")
    # what --signal=USR2@N does before the time limit: USR2 to every task of the job's steps
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    state = wait_state(job_id)
    assert state == "COMPLETED", state + _logs(log.parent)
    result = json.loads((tmp_path / "out" / "smoke_result.json").read_text())
    assert result["steps"] < 600
    # every rank stopped at the same step on the signal, which reached each (its log says so: a
    # rank's own record can lag when the signal reaches it after the others agreed on theirs)
    assert all(x["stopped_on"] == "SIGUSR2" and x["steps"] == result["steps"] for x in result["ranks"]), result
    logs = sorted(log.parent.glob(f"{job_id}_*_log.err"))
    assert len(logs) == 4 and all("received SIGUSR2" in f.read_text() for f in logs), _logs(log.parent)


def next_log(folder: Path, name: str, needle: str, timeout=120) -> Path:
    end = time.time() + timeout
    while time.time() < end:
        f = folder / name
        if f.exists() and needle in f.read_text(errors="replace"):
            return f
        time.sleep(0.5)
    raise AssertionError(f"'{needle}' never appeared in {folder / name}" + _logs(folder))


def wait_state(job_id: str, timeout=120) -> str:
    end = time.time() + timeout
    while time.time() < end:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        if out and out.split()[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            return out.split()[0]
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s")


def _logs(folder: Path) -> str:
    return "".join(f"\n--- {f}\n{f.read_text(errors='replace')[-3000:]}"
                   for f in sorted(Path(folder).glob("*")) if f.is_file())
