"""A real GRPO job with `actor.param_offload=true` at TP 1 and a tied-embedding model (issue 27,
defect 2): after every weight sync the rollout's weights equal the actor's, bitwise, and the actor
is offloaded again. One rank in this process, the HF rollout (its weights are plain HF parameters
that can be read back; vLLM's CPU engine holds them fused and gives no such view).

Before the fix the actor offloaded (`storage.resize_(0)`) when the export generator ended, before
the rollout had taken the last bucket, whose tensors are views of live parameters at TP 1: the
rollout then copied from 0-byte storage, which segfaults on CPU. The rollout's load_weights is
wrapped here to check each tensor's storage before it reads a byte, so the bug fails the job
(a weight-sync error) instead of killing the test process."""
import pytest
import torch

from jobs import MOVING, grpo, logs, metrics


@pytest.fixture
def tied_model(tiny_assets, tmp_path):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path / "tied", "llama", tied=True, layers=2)


def test_job_param_offload_sync_gives_the_rollout_the_actors_weights(tiny_assets, tied_model, tmp_path,
                                                                     monkeypatch):
    from verl_hpc.resharding.sync import WeightSync
    from verl_hpc.rollout.hf.engine import HFRollout

    load, sync, checks = HFRollout.load_weights, WeightSync.__call__, []

    def storage_checked(self, weights):
        def guarded():
            for name, t in weights:
                if t.untyped_storage().nbytes() == 0:
                    raise AssertionError(f"{name}: its storage was freed (actor offloaded) before the rollout "
                                         "read it")
                yield name, t
        return load(self, guarded())

    def compared(self, actor, rollout):
        out = sync(self, actor, rollout)
        engine = actor.engine
        offloaded = engine.offloader.device_bytes()["params"] == 0
        with engine.resident("forward"):
            want = {n: t.detach().clone() for n, t in engine.export_hf_weights()}
        got = rollout.model.state_dict()
        checks.append({"offloaded": offloaded, "tied": "lm_head.weight" not in want,
                       "differ": [n for n in want if not torch.equal(got[n], want[n])],
                       "lm_head": torch.equal(got["lm_head.weight"], want["model.embed_tokens.weight"])})
        return out

    monkeypatch.setattr(HFRollout, "load_weights", storage_checked)
    monkeypatch.setattr(WeightSync, "__call__", compared)
    out = tmp_path / "out"
    proc, summary = grpo(tiny_assets, out, f"model.path={tied_model}", "actor.param_offload=true", "parallel.tp=1",
                         "trainer.total_steps=3", *MOVING)
    assert proc.returncode == 0, logs(proc, out)
    assert summary["steps"] == 3 and len(checks) == 3, checks  # one (lazy) sync before each step's generation
    for c in checks:
        assert c == {"offloaded": True, "tied": True, "differ": [], "lm_head": True}, checks
    # every step's row reports its sync: 2 layers x 9 tensors + embedding + final norm (no lm_head: tied)
    assert [row["sync/tensors"] for row in metrics(out) if row.get("step", 0) >= 1] == [20.0] * 3
