"""The reward model's checkpoint record: frozen, named by folder, kind and fingerprint; a resume
with a model whose files differ is refused in one line; the judge's failure total carries over."""
from types import SimpleNamespace

import pytest

from verl_hpc.checkpoint.errors import CheckpointMismatchError
from verl_hpc.trainer.stages.rm_record import RewardModelRecord


def _folder(path, seed):
    """What the fingerprint reads: config.json and the safetensors files."""
    import torch
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    save_file({"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))}, str(path / "model.safetensors"))
    return path


def test_record_round_trip_and_refusal(tmp_path):
    a, b = _folder(tmp_path / "a", 1), _folder(tmp_path / "b", 2)
    judge = SimpleNamespace(failures_total=7)
    saved = RewardModelRecord(SimpleNamespace(path=str(a), kind="judge"), judge).state_dict()
    assert saved["kind"] == "judge" and saved["failures_total"] == 7 and len(saved["fingerprint"]) == 64
    again = SimpleNamespace(failures_total=0)
    RewardModelRecord(SimpleNamespace(path=str(a), kind="judge"), again).load_state_dict(saved)
    assert again.failures_total == 7  # judge/failures_total goes on across the resume
    with pytest.raises(CheckpointMismatchError) as e:
        RewardModelRecord(SimpleNamespace(path=str(b), kind="judge")).load_state_dict(saved)
    line = str(e.value)
    assert f"reward model (judge) at {a}" in line and f"reward.reward_model.path = {b}" in line and "\n" not in line
