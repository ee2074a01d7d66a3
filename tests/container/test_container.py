"""The CPU image, built and run for real: `containers/build.sh` (mmdebstrap + Charliecloud), then
jobs under the dev Slurm cluster with every rank inside `ch-run` (issue 18).

The first test builds the image (ch-image's cache makes an unchanged rebuild take about a minute;
a fresh build took 30-50 min on the loaded 2-core development machine). A failed build FAILS these tests: on a machine where the
build cannot even start (no charliecloud/mmdebstrap and no apt-get to install them) they fail
too, naming what is missing, so a container regression is never silently skipped.
"""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
from jobs import data_overrides, make_assets  # noqa: E402 - after REPO, as before

# A fresh build can take most of an hour on 2 busy cores (base root filesystem, apt, pip).
pytestmark = pytest.mark.timeout(3600)
IMAGE = "verl_hpc:cpu"
# The dev cluster's Slurm TmpFS (slurm.conf): PMIx keeps each step's directory there.
SLURM_TMPFS = "/var/spool/slurmd"
ENV = {**os.environ, "USER": os.environ.get("USER") or "root", "OMP_NUM_THREADS": "1"}


def run(cmd, timeout=600, **kw):
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout, **kw)


def tail(r) -> str:
    return f"rc={r.returncode}\n--- stdout\n{r.stdout[-5000:]}\n--- stderr\n{r.stderr[-5000:]}"


@pytest.fixture(scope="session")
def image():
    r = run(["bash", "containers/build.sh"], timeout=3300)
    assert r.returncode == 0, "containers/build.sh failed:\n" + tail(r)
    # ch-run binds only onto directories that exist in the image (the submitter does the same)
    image_dir = Path(r.stdout.strip().splitlines()[-1])
    for p in [REPO, Path(SLURM_TMPFS)]:
        (image_dir / str(p).lstrip("/")).mkdir(parents=True, exist_ok=True)
    return IMAGE


@pytest.fixture(scope="module", autouse=True)
def cluster_is_up():
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    states = set(r.stdout.split())
    assert r.returncode == 0 and states and states <= {"idle", "mixed", "allocated"}, (
        f"dev cluster not usable (sinfo: {r.stdout!r} {r.stderr!r}); run slurm/devcluster/start.sh")


def ch_run(image):
    return ["ch-run", f"--bind={REPO}", f"--bind={SLURM_TMPFS}", f"--cd={REPO}", image, "--"]


def batch(tmp_path, name, step_cmd, n=2, nodes=1, timeout=900):
    """`sbatch --wait` a script whose one step is `srun --mpi=pmix STEP_CMD` (N ranks on NODES
    nodes); returns (CompletedProcess, the job's output)."""
    script = tmp_path / f"{name}.sbatch"
    out = tmp_path / f"{name}.out"
    script.write_text("#!/bin/bash\nset -e\nexport PMIX_MCA_gds=hash OMPI_MCA_orte_tmpdir_base=/tmp\n"
                      f"srun --mpi=pmix --kill-on-bad-exit=1 {shlex.join(step_cmd)}\n")
    r = run(["sbatch", "--wait", f"-N{nodes}", f"-n{n}", f"--ntasks-per-node={n // nodes}", "--time=15", f"--output={out}", f"--job-name={name}",
             str(script)], timeout=timeout)
    return r, out.read_text(errors="replace") if out.exists() else ""


def test_image_holds_the_cpu_stack(image):
    code = ("import torch, vllm, megatron.core, h5py, mpi4py, verl_hpc, sys; "
            "print(sys.executable, torch.__version__, vllm.__version__, megatron.core.__version__)")
    r = run(ch_run(image) + ["python", "-c", code])
    assert r.returncode == 0, tail(r)
    exe, torch_v, vllm_v, mcore_v = r.stdout.split()[-4:]
    assert exe.startswith("/usr/bin/python") and torch_v == "2.13.0+cpu", r.stdout
    assert vllm_v.startswith("0.32.0") and mcore_v == "0.16.1", r.stdout
    r = run(ch_run(image) + ["h5ls", "--version"])
    assert r.returncode == 0, tail(r)


def check_ranks_agree(result, world):
    assert result["world_size"] == world and result["ok"], result
    ranks = sorted(result["ranks"], key=lambda x: x["rank"])
    assert [x["rank"] for x in ranks] == list(range(world))
    for x in ranks:  # Slurm, torch.distributed (gloo) and MPI (PMIx) all say the same
        assert x["launcher"] == "srun" and (x["torch_rank"], x["torch_world"]) == (x["rank"], world)
        assert (x["mpi_rank"], x["mpi_size"]) == (x["rank"], world), x


def test_srun_pmix_smoke_job_in_container(image, tmp_path):
    r, log = batch(tmp_path, "smoke", ch_run(image) + ["python", "-m", "verl_hpc.job", "configs/smoke.yaml",
                                                       f"trainer.output_dir={tmp_path}"])
    assert r.returncode == 0, tail(r) + log[-5000:]
    check_ranks_agree(json.loads((tmp_path / "smoke_result.json").read_text()), 2)


@pytest.mark.multinode
def test_srun_pmix_smoke_job_in_container_across_two_nodes(image, tmp_path):
    # the dev cluster's nodes are network namespaces with their own addresses: PMIx wire-up and
    # gloo go over the bridge between them, each rank in its own ch-run
    r, log = batch(tmp_path, "smoke2", ch_run(image) + ["python", "-m", "verl_hpc.job", "configs/smoke.yaml",
                                                        f"trainer.output_dir={tmp_path}"], n=2, nodes=2)
    assert r.returncode == 0, tail(r) + log[-5000:]
    result = json.loads((tmp_path / "smoke_result.json").read_text())
    check_ranks_agree(result, 2)
    assert len({x["host"] for x in result["ranks"]}) == 2, result["ranks"]


def test_submit_with_charliecloud_runtime(image, tmp_path):
    r = run([sys.executable, "-m", "verl_hpc.submit", "configs/smoke.yaml", f"trainer.output_dir={tmp_path}/out",
             f"slurm.log_dir={tmp_path}/logs/%j", "slurm.container.runtime=charliecloud",
             f"slurm.container.image={image}", f"slurm.container.mounts=[{SLURM_TMPFS}]"])
    assert r.returncode == 0, tail(r)
    assert "COMPLETED" in r.stdout and "SMOKE_RESULT" in r.stdout
    check_ranks_agree(json.loads((tmp_path / "out" / "smoke_result.json").read_text()), 2)
    # every rank's interpreter was the image's: submitit's batch script starts it through ch-run
    script = next((tmp_path / "logs").rglob("*_submission.sh")).read_text()
    assert f"ch-run --bind={REPO} --bind={SLURM_TMPFS} --cd={REPO} {image} -- python -u -m submitit" in script, script


def grpo(tmp_path, name, prefix, steps=2):
    root = make_assets(tmp_path / "assets")
    out = tmp_path / name
    # The tiny model is untrained: every reward is 0, so GRPO's advantages (and its policy gradient)
    # are 0 and only weight decay would move the weights, the same inside and out whatever the
    # rollouts were. The entropy bonus gives a gradient that depends on the sampled responses.
    cmd = prefix + [
        "-m", "verl_hpc.job", "configs/demo_rl.yaml", f"model.path={root}/model", *data_overrides(root),
        f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.val_every=0",
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=4",
        "actor.entropy_coeff=0.01", "tracking.backends=[jsonl]", "tracking.plots=false",
        "slurm.tasks_per_node=2"]
    r, log = batch(tmp_path, name, cmd)
    assert r.returncode == 0, f"{name}: " + tail(r) + log[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    norms = [row["actor/grad_norm"] for row in rows if "actor/grad_norm" in row]
    assert len(norms) == steps and min(norms) > 0, f"{name}: the actor did not train (grad norms {norms})"
    return out / "checkpoints" / f"step_{steps:06d}"


def test_grpo_in_container_gives_the_same_weights_as_outside(image, tmp_path):
    from verl_hpc.checkpoint.load import list_tensors, load_tensor

    inside = grpo(tmp_path, "inside", ch_run(image) + ["python"])
    outside = grpo(tmp_path, "outside", [sys.executable])
    names = sorted(n for n in list_tensors(outside) if n.startswith("actor/model/"))
    assert names and names == sorted(n for n in list_tensors(inside) if n.startswith("actor/model/"))
    for n in names:
        a, b = load_tensor(outside, n), load_tensor(inside, n)
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert bool((a == b).all()), f"{n}: max |diff| {(a.double() - b.double()).abs().max().item():.3g}"
