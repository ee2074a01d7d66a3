"""The sliced and delta weight sync through a real Megatron model on one gloo rank: the same
tensors as the full path bit for bit, a delta that carries exactly the changed elements, copies
dropped after a failure, the fallback and its errors, and the actor held resident under offload.
The layouts across ranks (TP/PP/VPP -> inference TP 1/2/4) are in tests/dist/models."""
import pytest
import torch

from verl_hpc.resharding import DigestSink, NullSink, PlanError, SliceSink, SyncError, WeightSync


@pytest.fixture
def model(one_rank_world, tmp_path):
    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    folder = make_tiny_model(tmp_path / "qwen2", "qwen2", layers=2)  # qkv bias, untied
    init_model_parallel(1, 1)
    m = build_gpt_model(load_arch(folder))
    load_hf_weights(m, folder)
    return m


def full_export(model):
    from verl_hpc.models import export_hf_weights

    return {n: t.clone() for n, t in export_hf_weights(model)}


def nudge(model, every: int):
    """Move every `every`-th element of each parameter (what an update does to a few bf16 values)."""
    moved = 0
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[::every] += 0.01
            moved += p.view(-1)[::every].numel()
    return moved


def test_sliced_delivers_the_full_paths_tensors_bitwise(model):
    full, sliced = DigestSink(), DigestSink()
    m_full = WeightSync(bucket_mb=0.05, mode="full")(model, full)
    m_sliced = WeightSync(bucket_mb=0.05, mode="sliced")(model, sliced)
    assert sliced.records == full.records  # names, order, shapes, dtypes and bytes
    assert m_full["sync/sliced"] == 0.0 and m_sliced["sync/sliced"] == 1.0
    assert m_sliced["sync/bytes"] == m_full["sync/bytes"]  # inference TP 1 keeps everything
    assert m_sliced["sync/wire_bytes"] == 0.0  # one rank: all from itself
    assert m_sliced["sync/changed_fraction"] == 1.0


def test_delta_sends_only_what_changed_and_stays_bitwise(model):
    syncer = WeightSync(bucket_mb=0.05, mode="sliced", delta=True)
    sink = SliceSink()
    first = syncer(model, sink)
    assert first["sync/bytes"] == first["sync/dense_bytes"]  # nothing to compare with yet: dense
    moved = nudge(model, 101)
    second = syncer(model, sink)
    assert sink.mismatches(full_export(model)) == []
    elements = second["sync/dense_bytes"] / 4
    # `moved` also counts Megatron's vocabulary padding rows, which are not HF elements: within 2 %
    assert second["sync/changed_fraction"] == pytest.approx(moved / elements, rel=0.02)
    # index mode (int32 position + float32 value) at ~1 %: 8 bytes per changed element
    assert second["sync/bytes"] == pytest.approx(8 * moved, rel=0.02)
    third = syncer(model, sink)  # nothing moved: nothing sent, the copy still whole
    assert third["sync/bytes"] == 0.0 and third["sync/changed_fraction"] == 0.0
    assert sink.mismatches(full_export(model)) == []


def test_delta_copies_are_dropped_after_a_failed_sync(model):
    class FailOnce(SliceSink):
        fail = True

        def load_weight_slices(self, items):
            if self.fail:
                self.fail = False
                for k, _ in enumerate(items):
                    if k == 2:
                        raise ValueError("injected")
            return super().load_weight_slices(items)

    syncer = WeightSync(bucket_mb=0.05, mode="sliced", delta=True)
    sink = FailOnce()
    with pytest.raises(SyncError, match="injected"):
        syncer(model, sink)
    assert not syncer.sliced.sent and not syncer.sliced.kept
    nudge(model, 53)
    again = syncer(model, sink)  # dense again, and right
    assert again["sync/bytes"] == again["sync/dense_bytes"]
    assert sink.mismatches(full_export(model)) == []


def test_auto_falls_back_to_full_for_a_consumer_that_cannot_say_its_slices(model):
    class WholeOnly:  # load_weights only, no weight_slices
        def load_weights(self, weights):
            self.names = [n for n, _ in weights]

    consumer = WholeOnly()
    assert WeightSync(bucket_mb=1)(model, consumer)["sync/sliced"] == 0.0
    assert "model.norm.weight" in consumer.names
    with pytest.raises(SyncError, match="resharding.mode=sliced.*weight_slices"):
        WeightSync(bucket_mb=1, mode="sliced")(model, WholeOnly())
    with pytest.raises(ValueError, match="resharding.delta needs"):
        WeightSync(bucket_mb=1, mode="full", delta=True)
    assert WeightSync(bucket_mb=1)(model, NullSink())["sync/sliced"] == 1.0


def test_an_impossible_inference_tp_falls_back_or_names_the_tensor(model):
    three = SliceSink(0, 3)  # 4 heads do not split over 3 ranks
    with pytest.raises(PlanError, match="resharding.mode=sliced: .*inference TP 3"):
        WeightSync(bucket_mb=1, mode="sliced")(model, three)
    auto = WeightSync(bucket_mb=1)
    assert auto(model, DigestSink())["sync/sliced"] == 1.0
    assert auto(model, three)["sync/sliced"] == 0.0  # the plan failed: the full path, said in the log
    assert auto.mode == "full"


def test_offloaded_actor_stays_resident_through_a_sliced_sync(one_rank_world, tmp_path):
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.megatron import Actor, MegatronEngine, default_options
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    folder = make_tiny_model(tmp_path / "model", "llama", tied=True, layers=2)
    init_model_parallel(1, 1)
    engine = MegatronEngine(default_options(model_path=str(folder), param_offload=True))
    actor = Actor(engine, ActorConfig())
    with engine.resident("forward"):
        want = {n: t.detach().clone() for n, t in engine.export_hf_weights()}
    sink = SliceSink()
    assert WeightSync(bucket_mb=1e-6, mode="sliced")(actor, sink)["sync/sliced"] == 1.0
    assert sink.mismatches(want) == []
    assert engine.offloader.device_bytes()["params"] == 0  # offloaded again once the sync is done
