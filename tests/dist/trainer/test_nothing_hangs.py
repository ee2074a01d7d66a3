"""Nothing hangs (issue 11): a reward function that never returns fails a 2-rank RL job within
reward.timeout_s + 30 s naming the function and the sample; a rank wedged between collectives
is failed by its stage watchdog within the limit, naming the rank and the stage."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from jobs import data_overrides

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


def test_hanging_reward_fails_two_rank_job_naming_function_and_sample(tmp_path, tiny_assets):
    root = tiny_assets
    marker = tmp_path / "hang_started"
    env = dict(os.environ, HANG_MARKER=str(marker), PYTHONPATH=f"{REPO}:{HERE}")
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--local", f"model.path={root}/model",
           *data_overrides(root), f"trainer.output_dir={tmp_path}/out", f"slurm.log_dir={tmp_path}/logs/%j",
           "slurm.tasks_per_node=2", "rollout.engine=hf", "trainer.total_steps=2", "data.train_batch_size=4",
           "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=2", "trainer.val_every=0",
           "tracking.backends=[jsonl]", "tracking.plots=false", "safety.allow_custom_code=true",
           "reward.custom_function=hanging_reward:hang_forever", "reward.on_error=raise", "reward.timeout_s=5",
           "trainer.collective_timeout_s=600", "trainer.stage_timeout_s=600"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        end = time.time() + 500
        while not marker.exists() and proc.poll() is None and time.time() < end:
            time.sleep(0.2)
        if not marker.exists():
            proc.kill()
            o, e = proc.communicate()
            raise AssertionError(f"the reward function was never called:\n{o[-3000:]}\n{e[-3000:]}")
        hung = time.time()
        out, err = proc.communicate(timeout=200)
        elapsed = time.time() - hung
    finally:
        proc.kill()
    assert proc.returncode != 0, out[-3000:] + err[-3000:]
    assert elapsed < 5 + 30, f"the job took {elapsed:.0f}s to fail after the reward function hung"
    m = re.search(r"error: (rank \d+: )?reward function hanging_reward:hang_forever timed out on sample "
                  r"(\S+) \(data_source '[^']+'\): did not return within reward.timeout_s=5s", out + err)
    assert m, out[-3000:] + err[-3000:]
    assert m.group(2).startswith("train.parquet:"), m.group(2)
    assert "Traceback" not in err, err[-3000:]


def test_wedged_rank_is_named_by_its_stage_watchdog(tmp_path, smoke_job, failure_after):
    proc = smoke_job(tmp_path, "slurm.tasks_per_node=2", "trainer.smoke.steps=200", "trainer.smoke.fail_rank=1",
                     "trainer.smoke.fail_at_step=2", "trainer.smoke.fail_mode=hang",
                     "trainer.collective_timeout_s=600", "trainer.stage_timeout_s=10",
                     "slurm.max_restarts=0")  # a stall is a death the restarts would relaunch: here it must end the job
    out, err, elapsed = failure_after(proc, tmp_path / "logs", "**/1/stderr.log", "hangs on purpose")
    assert proc.returncode != 0
    # 10 s limit + 1 s polling; the launcher then stops rank 0 (waiting in a collective); slack for load
    assert elapsed < 10 + 40, f"took {elapsed:.0f}s to fail a rank stalled for 10 s"
    assert "rank 1 exited with code 16" in err, err  # runtime/watchdog.py's exit code
    assert re.search(r"error: rank 1: stalled for 1\ds in stage 'smoke step 2' outside any collective "
                     r"\(trainer.stage_timeout_s=10\); stuck at \S+smoke.py:\d+ in _fail_on_purpose", err), err
