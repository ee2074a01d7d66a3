"""The weight sync with `actor.param_offload` (issue 27, defect 2), through the real Megatron engine
on one gloo rank: the export hands out views of live parameters (norm weights always, every weight
at TP 1), and the last bucket reaches the rollout only after the export generator is exhausted.
The actor must stay resident until the rollout has taken that last bucket; offloading earlier
(`storage.resize_(0)`) leaves the rollout copying from 0-byte storage (a segfault on CPU, an
illegal memory access on a GPU). The sink below checks each tensor's storage before it reads a
byte, so the bug shows as a failed assertion instead of ending the test process."""
import pytest
import torch

from verl_hpc.resharding import WeightSync


class CheckingSink:
    """Takes load_weights like a rollout; records each tensor's storage bytes at the moment it is
    consumed and copies its values only when the storage is still there."""

    def __init__(self):
        self.storage_bytes, self.values = {}, {}

    def load_weights(self, weights):
        for name, t in weights:
            self.storage_bytes[name] = t.untyped_storage().nbytes()
            if self.storage_bytes[name] >= t.numel() * t.element_size():
                self.values[name] = t.detach().clone()
        return {}


@pytest.fixture
def offloaded_actor(one_rank_world, tmp_path):
    from verl_hpc.engines.megatron import Actor, MegatronEngine, default_options
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "model", "llama", tied=True, layers=2)
    init_model_parallel(1, 1)
    engine = MegatronEngine(default_options(model_path=str(model), param_offload=True, grad_offload=True,
                                            optimizer_offload=True))
    return Actor(engine, ActorConfig())


@pytest.mark.parametrize("bucket_mb", [1e-6, 512])  # one tensor per bucket; the whole model in one
def test_rsh_offloaded_actor_stays_resident_until_the_rollout_took_the_last_bucket(offloaded_actor, bucket_mb):
    engine = offloaded_actor.engine
    assert engine.offloader.device_bytes()["params"] == 0  # idle: the weights are on the host
    with engine.resident("forward"):
        want = {n: t.detach().clone() for n, t in engine.export_hf_weights()}
    assert "lm_head.weight" not in want  # tied: the embedding is the output layer
    sink = CheckingSink()
    WeightSync(bucket_mb=bucket_mb)(offloaded_actor, sink)
    empty = sorted(n for n, b in sink.storage_bytes.items() if b == 0)
    assert not empty, f"handed to the rollout after the actor was offloaded: {empty}"
    assert sink.values.keys() == want.keys()
    assert all(torch.equal(sink.values[n], want[n]) for n in want)
    assert engine.offloader.device_bytes()["params"] == 0  # offloaded again once the sync is done
