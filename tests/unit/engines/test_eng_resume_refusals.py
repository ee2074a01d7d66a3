"""Resuming a checkpoint of another model (issue 50, "bad inputs"): each engine refuses it in one
line naming the architecture or the tensor at fault, before anything of the engine changes; and
the Megatron engine refuses an FSDP checkpoint in HF coordinates (an architecture Megatron does
not map), saying so. Checkpoints are one-rank FSDP engines' (tests/engine_states.py), loaded as
the checkpointer loads them (RoleLoader, which lists what the checkpoint holds)."""
import gc

import pytest
import torch

from engine_states import engine, load, make_batch, one_rank_world, save, update
from verl_hpc.checkpoint.errors import CheckpointLayoutError, CheckpointMismatchError

# checkpoint -> (error, the line's distinctive part) when resumed into a 2-layer tiny Llama
REFUSED = {
    "llama_3_layers": (CheckpointMismatchError, "model/decoder.layers.2.input_layernorm.weight (and 6 more) "
                                                "has no place in model.path ("),
    "llama_1_layer": (CheckpointMismatchError, "holds no model/decoder.layers.1.input_layernorm.weight (shape [128])"),
    "llama_ffn_192": (CheckpointMismatchError, "model/decoder.layers.0.mlp.linear_fc1.weight/gate has shape "
                                               "[192, 128]; model.path ("),
    "qwen2": (CheckpointLayoutError, "the checkpoint's model is Qwen2, model.path's is "),
    "olmo2": (CheckpointLayoutError, "the checkpoint's model is Olmo2, model.path's is "),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One gloo rank; the checkpoints of REFUSED and of the target model itself ("llama")."""
    from engine_states import tiny_unmapped_model
    from verl_hpc.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("refusals")
    folders = {"llama": make_tiny_model(tmp / "llama", "llama", layers=2, seed=1),
               "llama_3_layers": make_tiny_model(tmp / "llama3", "llama", layers=3, seed=1),
               "llama_1_layer": make_tiny_model(tmp / "llama1", "llama", layers=1, seed=1),
               "llama_ffn_192": make_tiny_model(tmp / "llama_ffn", "llama", layers=2, ffn=192, seed=1),
               "qwen2": make_tiny_model(tmp / "qwen2", "qwen2", layers=2, seed=1),
               "olmo2": tiny_unmapped_model(tmp / "olmo2", "olmo2", seed=1)}
    with one_rank_world(tmp / "world"):
        ckpts = {}
        for name, folder in folders.items():
            eng = engine("fsdp", folder)
            save(eng, tmp / name, 1, {"fsdp": 1})
            ckpts[name] = tmp / name / "step_000001"
            del eng
        gc.collect()
        yield dict(folders=folders, ckpts=ckpts)


def _snapshot(eng) -> dict:
    st = eng.state()
    return {"tensors": {(t.name, tuple(t.offsets)): t.local.clone() for t in st.tensors},
            "meta": st.meta, "lr": eng.lr}


def _refused(eng, ckpt, error, text):
    with pytest.raises(error) as e:
        load(eng, ckpt)
    msg = str(e.value)
    print(f"{ckpt.parent.name}: {msg}")
    assert "\n" not in msg and text in msg, msg


def _unchanged(eng, before):
    after = _snapshot(eng)
    assert after["meta"] == before["meta"] and after["lr"] == before["lr"]
    assert after["tensors"].keys() == before["tensors"].keys()
    assert all(torch.equal(after["tensors"][k], v) for k, v in before["tensors"].items())


def test_fsdp_engine_refuses_another_models_checkpoint_and_changes_nothing(world):
    eng = engine("fsdp", world["folders"]["llama"])
    update(eng, make_batch(3))  # moments and a step count that a partial load would overwrite
    before = _snapshot(eng)
    for name, (error, text) in REFUSED.items():
        _refused(eng, world["ckpts"][name], error, text)
    _unchanged(eng, before)
    load(eng, world["ckpts"]["llama"])  # its own model's checkpoint loads
    assert eng.steps_applied == 0 and eng.optimizer.state[next(eng.model.parameters())]["step"] == 0


def test_megatron_engine_refuses_hf_coordinates_and_another_model(world):
    from verl_hpc.parallel import cpu_compat, destroy_model_parallel, init_model_parallel

    init_model_parallel(1, 1)
    try:
        eng = engine("megatron", world["folders"]["llama"])
        update(eng, make_batch(3))
        before = _snapshot(eng)
        _refused(eng, world["ckpts"]["olmo2"], CheckpointLayoutError,
                 "the FSDP engine's checkpoint of Olmo2 names its tensors in 'hf' coordinates: this architecture "
                 "is not in Megatron's coordinates")
        for name in ("llama_3_layers", "llama_1_layer", "llama_ffn_192", "qwen2"):
            _refused(eng, world["ckpts"][name], *REFUSED[name])
        _unchanged(eng, before)
        load(eng, world["ckpts"]["llama"])  # the FSDP engine's checkpoint of this model loads
        assert eng.steps_applied == 0
    finally:
        destroy_model_parallel()
        cpu_compat.revert()


def test_a_bf16_megatron_engine_takes_its_fp32_masters_from_an_fsdp_checkpoint():
    """The FSDP engine saves fp32 weights only (model/ are its master weights): a bf16 Megatron
    engine (a GPU's) fills its fp32 masters from them exactly, and its bf16 parameters with their
    rounding. On slabs as that engine would ask for them (no bf16 Megatron engine on a CPU)."""
    from verl_hpc.checkpoint import ShardedTensor
    from verl_hpc.engines.megatron.state import _masters_from_fp32_model

    g = torch.Generator().manual_seed(0)
    stored = {"model/w": torch.randn(6, 4, generator=g), "optim/exp_avg/w": torch.randn(6, 4, generator=g)}
    param, main, moment = torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(3, 4), torch.zeros(3, 4)
    slabs = [ShardedTensor("model/w", param, (6, 4), (3, 0)), ShardedTensor("optim/main/w", main, (6, 4), (3, 0)),
             ShardedTensor("optim/exp_avg/w", moment, (6, 4), (3, 0))]
    targets, casts = _masters_from_fp32_model(slabs)
    assert [t.name for t in targets] == ["model/w", "model/w", "optim/exp_avg/w"]
    assert all(t.local.dtype == torch.float32 for t in targets)
    for t in targets:
        t.local.copy_(stored[t.name][3:])
    for dst, buf in casts:
        dst.copy_(buf)
    assert torch.equal(main, stored["model/w"][3:]) and torch.equal(moment, stored["optim/exp_avg/w"][3:])
    assert torch.equal(param, stored["model/w"][3:].to(torch.bfloat16))
