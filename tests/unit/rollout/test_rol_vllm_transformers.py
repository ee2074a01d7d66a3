"""vLLM's Transformers modelling backend in a training process (rollout/vllm/transformers_backend.py), without an
engine (the GRPO jobs through it: tests/jobs/test_vllm_backend_archs.py):
- the target the rollout wraps is still where it was, and vLLM's compile decorator still edits the class it
  is given in place (when vLLM stops doing that, `classes_kept` has nothing left to undo: this names it);
- `restore` puts a decorated class back as it was and moves the instances vLLM built onto a subclass that
  keeps the decoration, so a model of the class builds and runs outside vLLM afterwards;
- the names the engines send for a tensor the folder stores under another (GPT-NeoX's head), the choice of
  the backend, and the sliced sync's full path for it at inference TP > 1."""
import pytest
import torch
from torch import nn

from arch_matrix import make_arch
from verl_hpc.rollout.vllm import transformers_backend as vllm_transformers
from verl_hpc.rollout.vllm import versions

pytest.importorskip("vllm", reason="the backend is vLLM's")


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None):
        return self.lin(inputs_embeds)


def test_the_wrapped_target_still_decorates_the_class_it_is_given_in_place():
    from vllm.compilation.decorators import support_torch_compile
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.model_executor.models.transformers.base import Base

    assert callable(Base.__dict__.get("_decorate_cls_for_torch_compile")), vllm_transformers.TARGET

    class Fresh(Toy):
        pass

    support_torch_compile(dynamic_arg_dims={"inputs_embeds": 1})(Fresh)
    assert TorchCompileWithNoGuardsWrapper in Fresh.__bases__ and "__call__" in Fresh.__dict__
    with pytest.raises(AssertionError, match="Current vLLM config is not set"):
        Fresh()


def test_restore_puts_the_class_back_and_keeps_vllms_instances_decorated():
    import weakref

    from vllm.compilation.decorators import support_torch_compile
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config

    class Model(Toy):
        pass

    before_bases, before = Model.__bases__, dict(Model.__dict__)
    support_torch_compile(dynamic_arg_dims={"inputs_embeds": 1})(Model)
    eager = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))  # enforce_eager's
    with set_current_vllm_config(eager):
        owner = nn.ModuleDict({"model": Model()})  # what vLLM builds while the class is decorated
    vllm_transformers.restore(Model, before_bases, before, weakref.ref(owner))
    assert Model.__bases__ == before_bases and dict(Model.__dict__).keys() == before.keys()
    assert all(Model.__dict__[k] is v for k, v in before.items() if k not in ("__dict__", "__weakref__"))
    built = Model()  # outside vLLM, as the training engine builds it
    x = torch.randn(2, 4)
    assert torch.equal(built(inputs_embeds=x), built.lin(x))
    vllm_model = owner["model"]
    assert type(vllm_model).__mro__[1] is Model and TorchCompileWithNoGuardsWrapper in type(vllm_model).__mro__
    assert vllm_model.do_not_compile  # set by the decorated __init__ it was built with
    assert torch.equal(vllm_model(inputs_embeds=x), vllm_model.lin(x))  # the decorated __call__


def test_gpt_neox_head_is_sent_under_the_models_name_and_handed_to_vllm_under_the_folders(tmp_path):
    from verl_hpc.rollout.weights import checkpoint_weight_names

    neox, phi = make_arch(tmp_path / "neox", "gpt_neox"), make_arch(tmp_path / "phi", "phi")
    assert "embed_out.weight" in checkpoint_weight_names(neox)
    assert vllm_transformers.checkpoint_aliases(neox, checkpoint_weight_names(neox)) == {
        "lm_head.weight": "embed_out.weight"}
    assert vllm_transformers.checkpoint_aliases(phi, checkpoint_weight_names(phi)) == {}
    # GPT-NeoX and Phi-1/2 have a class of vLLM's own in 0.25 and none in 0.32 (its backend serves
    # them); 0.25's Phi class does not load this folder (vLLM's probe: a weight slice past the end of
    # a 256-wide tensor), so the backend serves it there too; Starcoder2 has none in either
    release = versions.release().version
    assert vllm_transformers.choose_impl(str(neox)) == {"0.25.0": None, "0.32.0": "transformers"}[release]
    assert vllm_transformers.choose_impl(str(phi)) == "transformers"
    assert vllm_transformers.choose_impl(str(make_arch(tmp_path / "sc2", "starcoder2"))) == "transformers"


def test_the_sliced_sync_takes_the_full_path_for_the_backend_at_inference_tp_above_one(caplog):
    """An engine that says it cannot be cut (VLLMRollout.sliced_problem: vLLM's Transformers backend at
    rollout.tp > 1): resharding.mode=auto takes the full path, naming why once; mode=sliced is refused."""
    import logging

    from verl_hpc.resharding.sync import SyncError, WeightSync

    class Rollout:  # the two things the choice reads of a rollout engine
        sliced_problem = vllm_transformers.SLICED_WHY

        def weight_slices(self):
            return 0, 2

    class Actor:  # an engine with local shards (a sliced source)
        def exported_model(self):
            raise AssertionError("the choice never opens the shards")

    with caplog.at_level(logging.INFO, logger="verl_hpc.resharding.sync"):
        assert WeightSync(bucket_mb=1, mode="auto")._choose(Actor(), Rollout()) is None
    assert "the full-tensor path (vLLM's Transformers modelling backend cuts each tensor" in caplog.text
    with pytest.raises(SyncError, match="resharding.mode=sliced: vLLM's Transformers modelling backend"):
        WeightSync(bucket_mb=1, mode="sliced")._choose(Actor(), Rollout())
