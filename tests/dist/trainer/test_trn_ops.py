"""Operating a run, end to end through the real RL trainer (local launcher): two jobs in different
namespaces side by side with the SAME output folder setting, then a resume across namespaces.

Job A (team-a, 2 ranks): safety.debug (anomaly detection + cross-rank checks every step) and
safety.profiling (a torch.profiler trace per rank for step 2). Job B (team-b, 1 rank, at the same
time): pushes to a real Pushgateway and alerts a local webhook; a reward collapse injected at step 3
(tests/faults.py) with the rollback guard allowed no rollback (trainer.rollback.max_rollbacks=0) makes it fail there,
so the failure path is the one shown.
The test lists every file each job touched and asserts that none is shared.
"""
import subprocess
import sys
from pathlib import Path

import pytest
from ops_services import families, groups, pushgateway, samples, webhook_receiver
from faults import env
from jobs import REPO, logs, run_here, small


@pytest.fixture
def assets(tiny_assets):
    return tiny_assets


def start(tmp_path, namespace, ranks, *overrides, environment=None):
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--local",
           f"slurm.tasks_per_node={ranks}", f"trainer.namespace={namespace}",
           f"trainer.output_dir={tmp_path}/out", *overrides]  # the same folder setting for both
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment)


def files_under(root: Path) -> set:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.mark.long  # three launches side by side, 60 CPU-s (make test-long). make test keeps each piece:
# two namespaces at once sharing no file on the Slurm tier (tests/slurm/test_slurm_namespaces.py), the
# folders, the job name and the refused resume (tests/unit/ops/test_ops_namespace.py), the debug and
# profiling switches (test_ops_safety.py), the Pushgateway and the webhook (test_ops_pushgateway.py,
# test_ops_alerts.py), the rollback guard's give-up in a job (tests/jobs/test_tasks_guard.py)
def test_two_namespaces_side_by_side_share_no_file(assets, tmp_path):
    common = small(assets, "rollout.n=2", "trainer.total_steps=2", "checkpoint.save_every=1")
    with pushgateway(tmp_path) as gw, webhook_receiver() as (hook, alerts):
        a = start(tmp_path, "team-a", 2, *common, "safety.debug=true", "safety.profiling=true",
                  "safety.profile_steps=[2]")
        b = start(tmp_path, "team-b", 1, *common, "tracking.backends=[jsonl,prometheus]",
                  f"tracking.pushgateway_url={gw}", f"tracking.alert_webhook={hook}",
                  "trainer.total_steps=3", "trainer.rollback.enable=true", "trainer.rollback.max_rollbacks=0",
                  environment=env(regression_at_steps=[3]))
        out_a, err_a = a.communicate(timeout=900)
        out_b, err_b = b.communicate(timeout=900)
        pushed, fam = groups(gw), families(gw)
    a_out, b_out = tmp_path / "team-a" / "out", tmp_path / "team-b" / "out"
    assert a.returncode == 0, logs(subprocess.CompletedProcess([], a.returncode, out_a, err_a), a_out)
    assert b.returncode != 0 and "reward/score/mean dropped at step 3" in err_b + out_b + \
        "".join(p.read_text(errors="replace") for p in b_out.glob("**/*.log"))

    # every file of each job is under its own namespace folder; no path is shared
    a_files, b_files = files_under(tmp_path / "team-a"), files_under(tmp_path / "team-b")
    print("team-a touched:", *sorted(a_files), "team-b touched:", *sorted(b_files), sep="\n  ")
    others = files_under(tmp_path) - {f"team-a/{f}" for f in a_files} - {f"team-b/{f}" for f in b_files}
    assert others <= {"pushgateway.log"}, others  # nothing of either job outside its namespace
    assert {"out/checkpoints/step_000002/index.json", "out/rl_summary.json", "out/metrics.jsonl"} <= a_files
    assert {"out/checkpoints/step_000001/index.json", "out/metrics.jsonl"} <= b_files

    # job A: the banner, a profiler trace per rank for step 2, and the cross-rank checks passed
    text_a = out_a + err_a + "".join(p.read_text(errors="replace") for p in a_out.glob("**/*.log"))
    assert "SAFETY SWITCHES ON" in text_a and "safety.debug = true" in text_a
    assert sorted(f for f in a_files if f.startswith("out/profiles/")) == [
        "out/profiles/step_000002_rank_00000.json", "out/profiles/step_000002_rank_00001.json"]

    # job B: its failure reached the webhook and the Pushgateway, labelled with its namespace
    (ctype, body), = alerts
    assert body["event"] == "failed" and body["namespace"] == "team-b" and body["step"] == 2
    assert "RollbackError" in body["details"]["reason"]
    (group,) = pushed
    assert group["labels"]["namespace"] == "team-b"
    assert group["labels"]["job"] == "team-b-verl_hpc_demo_rl"  # demo_rl.yaml's slurm.job_name, prefixed
    me = dict(namespace="team-b", experiment="demo_rl")
    assert samples(fam["verl_hpc_run_outcome"], outcome="failed", **me)[0].value == 1
    latency = samples(fam["verl_hpc_rollout_latency_seconds"], **me)
    assert [s.value for s in latency if s.name.endswith("_count")] == [2]  # steps 1 and 2 (logged)

    # a team-b job may not resume from team-a's checkpoint: the rank of such a job, in this process
    # (tests/jobs.py's run_here; the command line's start-up adds nothing to the refusal)
    c, _ = run_here("configs/demo_rl.yaml", tmp_path / "c", "trainer.namespace=team-b",
                    f"trainer.resume={a_out}/checkpoints", *common)
    text_c = c.stdout + c.stderr + "".join(p.read_text(errors="replace")
                                          for p in (tmp_path / "team-b" / "c").glob("**/*.log"))
    assert c.returncode != 0, text_c[-3000:]
    assert "refusing to resume from" in text_c and "namespace 'team-a'" in text_c, text_c[-3000:]
