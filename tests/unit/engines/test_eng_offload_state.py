"""A checkpoint's save and load with every offload on (issue 27, defect 1), through the real Megatron
engine on one gloo rank: the engine makes resident what the state needs, its parameters and
optimizer states, and leaves the gradient buffers dropped (on a GPU the fp32 size of the model that
is not mapped while the state is copied); everything is offloaded again afterwards, including the
Adam moments the save creates on an engine that has not stepped yet."""
import pytest
import torch


@pytest.fixture
def engine(one_rank_world, tmp_path):
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "model", "llama", layers=2)
    init_model_parallel(1, 1)
    return MegatronEngine(default_options(model_path=str(model), param_offload=True, grad_offload=True,
                                          optimizer_offload=True))


def _spy(monkeypatch, engine, name):
    """Wrap engine.py's `name` (engine_state / load_engine_state): record the device bytes per kind
    while it runs."""
    from verl_hpc.engines.megatron import engine as engine_module

    seen, real = [], getattr(engine_module, name)

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(engine.offloader.device_bytes())
        return out

    monkeypatch.setattr(engine_module, name, spy)
    return seen


def test_eng_state_and_load_keep_the_gradients_offloaded(engine, monkeypatch):
    saved = _spy(monkeypatch, engine, "engine_state")
    loaded = _spy(monkeypatch, engine, "load_engine_state")
    assert engine.offloader.device_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
    st = engine.state()
    assert saved[0]["grads"] == 0, f"gradient buffers resident during state(): {saved[0]}"
    assert saved[0]["params"] > 0 and saved[0]["optimizer"] > 0  # the state's own tensors are there
    assert engine.offloader.device_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
    by_name = {t.name: t.local for t in st.tensors}
    assert any(n.startswith("optim/exp_avg/") for n in by_name)

    def load_into(slabs):  # the saved values back, as the checkpoint reader would write them
        for s in slabs:
            s.local.copy_(by_name[s.name])

    engine.load_state(load_into, st.meta)
    assert loaded[0]["grads"] == 0 and loaded[0]["params"] > 0 and loaded[0]["optimizer"] > 0
    assert engine.offloader.device_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
    again = {t.name: t.local for t in engine.state().tensors}
    assert all(torch.equal(again[n], by_name[n]) for n in by_name)
