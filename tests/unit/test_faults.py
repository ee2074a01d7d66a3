"""tests/faults.py, the faults tests inject into a job (docs/testing.md, "Faults in tests"): in this
process for a block, and across the process boundary through tests/faults_site/sitecustomize.py,
which patches each module right after its import without importing torch or verl_hpc itself, and
still runs the interpreter's own sitecustomize."""
import subprocess
import sys

import pytest

import faults
from jobs import REPO

CHILD = """
import sys
assert sys.meta_path[0].__class__.__name__ == "_PatchAfterImport", sys.meta_path
assert "torch" not in sys.modules and not [m for m in sys.modules if m.startswith("verl_hpc")]
import verl_hpc.trainer.stages.sampling as sampling, verl_hpc.trainer.stages.correction as correction
assert sampling.StepSampler._score.__wrapped__.__module__ == "verl_hpc.trainer.stages.sampling"
assert correction.apply.__wrapped__.__module__ == "verl_hpc.trainer.stages.correction"
print("patched")
"""


@pytest.mark.heavy
def test_a_subprocess_patches_each_module_on_import_and_runs_the_next_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('the interpreter sitecustomize ran')\n")
    env = faults.env({"PYTHONPATH": str(other)}, regression_at_steps=[2], rollout_logprob_shift=0.5)
    assert env["PYTHONPATH"].split(":")[0] == str(faults.SITE)
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == "the interpreter sitecustomize ran patched".split()


def test_an_unknown_fault_is_refused_here_and_in_the_subprocess():
    with pytest.raises(ValueError, match="unknown test faults"):
        faults.env(regresion_at_steps=[2])
    with pytest.raises(ValueError, match="unknown test faults"), faults.injected(regresion_at_steps=[2]):
        pass
    env = faults.env({}, regression_at_steps=[2])
    env[faults.ENV] = '{"regresion_at_steps": [2]}'  # what env() refuses: the site must not run without it
    proc = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 70 and "ran" not in proc.stdout and "unknown test faults" in proc.stderr


def test_injected_puts_the_functions_back():
    from verl_hpc.trainer.stages import correction, sampling
    from verl_hpc.trainer.placement import rollout_worker
    from verl_hpc.trainer.programs import rl

    before = (correction.apply, correction.old_log_prob_path, sampling.StepSampler._score,
              rollout_worker.RolloutWorker._extend, rl.RLTrainer.checked_step)
    with faults.injected(regression_at_steps=[1], rollout_logprob_shift=0.0, warning_signal_at_step=0,
                         rollout_chunk_delay_s=0.0):
        during = (correction.apply, correction.old_log_prob_path, sampling.StepSampler._score,
                  rollout_worker.RolloutWorker._extend, rl.RLTrainer.checked_step)
        assert all(d is not b and d.__wrapped__ is b for d, b in zip(during, before))
    assert (correction.apply, correction.old_log_prob_path, sampling.StepSampler._score,
            rollout_worker.RolloutWorker._extend, rl.RLTrainer.checked_step) == before
