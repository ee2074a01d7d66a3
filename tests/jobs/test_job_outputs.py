"""A rank's output folders (issue 83, item 3): `python -m verl_hpc.job` with a trainer.output_dir it
cannot write (launch/*.sbatch run it without the submitter's checks) stops at its start, before
it builds anything, with the line the submitter prints for the same config and exit code 2; it
used to build the model and end in an OSError traceback when it opened metrics.jsonl."""
import os

import pytest

from jobs import data_overrides, run_here


def _read_only(monkeypatch, folder):
    """`folder` read-only: its mode, and os.access as a user other than root sees it (root writes
    through any mode, and the suite may run as root)."""
    folder.mkdir()
    folder.chmod(0o555)
    real = os.access

    def access(path, mode, *a, **k):
        inside = os.path.abspath(path) == str(folder) or os.path.abspath(path).startswith(f"{folder}/")
        return False if inside and mode & os.W_OK else real(path, mode, *a, **k)

    monkeypatch.setattr(os, "access", access)


@pytest.mark.parametrize("how", ["read-only", "a file"])
def test_an_output_dir_the_rank_cannot_write_stops_it_before_any_model(tmp_path, tiny_assets, monkeypatch, how):
    from verl_hpc import runtime
    from verl_hpc.config import load_config
    from verl_hpc.launcher.preflight import output_problems

    out = tmp_path / "out"
    if how == "a file":
        out.write_text("not a folder")
    else:
        _read_only(monkeypatch, out)
    built = []  # runtime.bootstrap comes before every model, engine and the tracker's files
    monkeypatch.setattr(runtime, "bootstrap", lambda *a, **k: built.append(1) or pytest.fail("the rank went on"))
    overrides = [f"model.path={tiny_assets}/model", *data_overrides(tiny_assets), "rollout.engine=hf",
                 "trainer.total_steps=1", "tracking.backends=[jsonl]"]
    try:
        proc, _ = run_here("configs/demo_rl.yaml", out, *overrides)
    finally:
        if out.is_dir():
            out.chmod(0o755)
    # the submitter's words for this config (launcher/preflight.py), as `submit` prints them
    wanted = output_problems(load_config("configs/demo_rl.yaml", [f"trainer.output_dir={out}",
                                                                  "slurm.tasks_per_node=1", *overrides]))
    assert len(wanted) == 1 and wanted[0].startswith(f"trainer.output_dir: '{out}' is "), wanted
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"error: {wanted[0]}"], proc.stderr[-3000:]
    assert not built
