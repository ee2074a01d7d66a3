"""Two jobs in different namespaces at once on the dev cluster (slurm/devcluster/start.sh), given the
SAME output and log folder settings: every file each touched is listed, and none is shared."""
import json
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def test_two_namespaces_at_once_touch_no_common_file(tmp_path):
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip(), f"dev cluster not usable: {r.stdout!r} {r.stderr!r}"
    procs = {ns: subprocess.Popen([sys.executable, "-m", "verl_hpc.submit", "configs/smoke.yaml",
                                   f"trainer.namespace={ns}", f"trainer.output_dir={tmp_path}/out",
                                   f"slurm.log_dir={tmp_path}/logs/%j", "slurm.tasks_per_node=2",
                                   "slurm.time_min=5", "trainer.smoke.steps=10"],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for ns in ("team-a", "team-b")}
    outputs = {ns: p.communicate(timeout=300) for ns, p in procs.items()}
    for ns, p in procs.items():
        assert p.returncode == 0, f"{ns}: {outputs[ns][0][-3000:]}{outputs[ns][1][-3000:]}"

    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    touched = {ns: [f for f in files if ns in f.parts] for ns in procs}
    for ns, mine in touched.items():
        print(f"{ns} touched:", *map(str, mine), sep="\n  ")
    assert all(("team-a" in f.parts) != ("team-b" in f.parts) for f in files), files  # each file: one job
    assert not set(touched["team-a"]) & set(touched["team-b"])
    for ns in procs:
        result = json.loads((tmp_path / ns / "out" / "smoke_result.json").read_text())
        assert result["ok"] and result["world_size"] == 2
        scripts = list((tmp_path / "logs" / ns).glob("*/*_submission.sh"))
        assert scripts, touched[ns]
        assert f"#SBATCH --job-name={ns}-verl_hpc" in scripts[0].read_text()  # the Slurm job name too
    ids = {ns: {p.parts[2] for p in touched[ns] if p.parts[0] == "logs"} for ns in procs}
    assert ids["team-a"] and ids["team-b"] and not ids["team-a"] & ids["team-b"]  # two Slurm jobs
