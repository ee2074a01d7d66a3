"""trainer.namespace: folders, Slurm job name, and the refusal to cross into another namespace's
checkpoints (on resume and on save)."""
from types import SimpleNamespace

import pytest
import torch

from verl_hpc.checkpoint.namespace import CheckpointNamespaceError, check_namespace, recorded_namespace
from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.trainer.programs.base import make_checkpointer


def test_namespace_prefixes_every_folder_and_the_job_name(tmp_path):
    cfg = load_config(None, ["trainer.namespace=team-a", f"trainer.output_dir={tmp_path}/out"])
    assert cfg.trainer.output_dir == f"{tmp_path}/team-a/out"
    assert cfg.checkpoint.dir == f"{tmp_path}/team-a/out/checkpoints"
    assert cfg.slurm.log_dir == f"{tmp_path}/team-a/out/slurm/%j"  # moved with the output folder
    assert cfg.trainer.hf_output_dir == f"{tmp_path}/team-a/out/hf"
    assert cfg.slurm.job_name == "team-a-verl_hpc"
    again = load_config(None, [f"{k}={v}" for k, v in [("trainer.namespace", "team-a"),
                                                       ("trainer.output_dir", cfg.trainer.output_dir),
                                                       ("slurm.job_name", cfg.slurm.job_name)]])
    assert again.trainer.output_dir == cfg.trainer.output_dir and again.slurm.job_name == cfg.slurm.job_name
    explicit = load_config(None, ["trainer.namespace=b", "checkpoint.dir=/scratch/ckpt", "slurm.log_dir=/logs/%j"])
    assert explicit.checkpoint.dir == "/scratch/b/ckpt" and explicit.slurm.log_dir == "/logs/b/%j"
    plain = load_config(None, [])
    assert plain.trainer.output_dir == "outputs/verl_hpc/run" and plain.slurm.job_name == "verl_hpc"


@pytest.mark.parametrize("bad", ["team a", "../up", "a/b", "-x"])
def test_bad_namespace_is_named(bad):
    with pytest.raises(ConfigError, match="trainer.namespace = .*letters, digits"):
        validate(load_config(None, [f"trainer.namespace={bad}", "trainer.output_dir=/tmp/o"]))


def _checkpointer(tmp_path, namespace, resume="auto"):
    cfg = load_config(None, [f"checkpoint.dir={tmp_path}/shared_ckpt", f"trainer.output_dir={tmp_path}/out",
                             f"trainer.resume={resume}"])
    cfg.trainer.namespace = namespace  # the folder is shared on purpose: the guard must refuse
    ctx = SimpleNamespace(rank=0, world_size=1, generator=torch.Generator().manual_seed(0))
    return make_checkpointer(cfg, ctx, engines={}, states={}, fmt="test", total_steps=cfg.trainer.total_steps)


def test_checkpoints_of_another_namespace_are_refused(tmp_path):
    a = _checkpointer(tmp_path, "team-a")
    assert a.resume() == 0
    a.maybe_save(1, force=True)
    assert recorded_namespace(tmp_path / "shared_ckpt") == "team-a"
    assert _checkpointer(tmp_path, "team-a").resume() == 1  # its own: fine

    with pytest.raises(CheckpointNamespaceError, match=r"refusing to resume from .*namespace 'team-a'.*"
                                                        r"trainer.namespace='team-b'"):
        _checkpointer(tmp_path, "team-b").resume()
    with pytest.raises(CheckpointNamespaceError, match=r"refusing to resume from .*namespace 'team-a'"):
        _checkpointer(tmp_path, "team-b", resume=f"{tmp_path}/shared_ckpt").resume()  # named, not found
    with pytest.raises(CheckpointNamespaceError, match="refusing to save into"):
        _checkpointer(tmp_path, "team-b", resume="never").resume()
    b = _checkpointer(tmp_path, "team-b", resume="never")
    with pytest.raises(CheckpointNamespaceError, match="refusing to save into"):
        b.maybe_save(5, force=True)  # the check also holds without resume() first
    with pytest.raises(CheckpointNamespaceError, match="belong to namespace 'team-a', .*trainer.namespace=''"):
        _checkpointer(tmp_path, "").resume()  # no namespace is a namespace too
    check_namespace(tmp_path / "nothing_here", "team-b", "save into")  # an empty folder belongs to no one
