"""The adapter-only sync into vLLM (resharding/adapter_sync.py, VLLMRollout.load_adapter): an adapter
loaded from tensors in memory gives the log-probs of Hugging Face peft with the same adapter, a new
version replaces the old one and is what the outputs report, and a rollout that did not take an
update is caught by the trainer's check (StaleAdapterError). One vLLM engine for the module."""
import pytest
import torch

from lora_reference import HF_TARGETS, peft_model, random_adapter
from rol_helpers import TOL, max_diff, prompts_of_lengths, teacher_forced_logprobs

RANK, ALPHA = 4, 8.0
PROMPTS = prompts_of_lengths(5, 9, 3)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.vllm.engine import VLLMRollout

    with VLLMRollout(tiny_model, **default_engine_args("vllm", max_prompt_length=32, max_response_length=8),
                     lora_rank=RANK) as eng:
        yield eng


def _peft(tiny_model, adapter):
    from peft import set_peft_model_state_dict

    m = peft_model(tiny_model, RANK, ALPHA, tuple(HF_TARGETS), dtype=torch.float32)
    set_peft_model_state_dict(m, adapter)
    return m.eval()


def _config():
    from verl_hpc.models.lora_names import peft_config

    return peft_config(RANK, ALPHA, tuple(HF_TARGETS), use_rslora=False)


def _spec():
    from verl_hpc.rollout.sampling import default_spec

    return default_spec(n=2, temperature=1.0, max_tokens=8, seed=3)


class FakeActor:
    """What AdapterSync reads from an actor's engine, without Megatron."""

    def __init__(self, adapter, version):
        self.adapter, self.adapter_version = adapter, version

    def export_adapter(self):
        yield from self.adapter.items()

    def adapter_config(self):
        return _config()


def test_an_adapter_from_memory_gives_peft_logprobs(engine, tiny_model, hf):
    base = engine.generate(PROMPTS, _spec())
    assert base.adapter_version is None
    adapter = random_adapter(tiny_model, RANK, ALPHA, seed=1)
    out = engine.load_adapter(adapter.items(), _config(), version=3)
    assert out["tensors"] == len(adapter) and out["bytes"] == sum(t.numel() * 4 for t in adapter.values())
    result = engine.generate(PROMPTS, _spec())
    assert result.adapter_version == 3
    assert result.response_ids != base.response_ids, "the adapter changes what is sampled"
    model = _peft(tiny_model, adapter)
    for row in range(len(result)):
        prompt = PROMPTS[result.prompt_index[row]]
        ref = teacher_forced_logprobs(model, prompt, result.response_ids[row])
        assert max_diff([result.logprobs[row]], [ref]) <= TOL
        plain = teacher_forced_logprobs(hf, prompt, result.response_ids[row])
        assert max_diff([result.logprobs[row]], [plain]) > 10 * TOL


def test_a_new_version_replaces_the_old_and_the_sync_is_checked(engine, tiny_model):
    from verl_hpc.resharding import AdapterSync, StaleAdapterError, check_generated

    syncer = AdapterSync()
    v1, v2 = (random_adapter(tiny_model, RANK, ALPHA, seed=s) for s in (5, 6))
    metrics = syncer(FakeActor(v1, 4), engine)
    assert metrics["sync/adapter_version"] == 4.0 and metrics["sync/bytes"] == sum(t.numel() * 4 for t in v1.values())
    first = engine.generate(PROMPTS, _spec())
    check_generated(first, syncer)  # version 4, as synced
    syncer(FakeActor(v2, 5), engine)
    second = engine.generate(PROMPTS, _spec())
    assert second.adapter_version == 5 and second.response_ids != first.response_ids
    check_generated(second, syncer)
    ids = engine.llm.collective_rpc(lambda worker: sorted(worker.model_runner.lora_manager.list_adapters()))
    assert ids == [[6]], "only the newest adapter is registered (id = version + 1)"

    # the rollout that never takes the update (a load_adapter that does nothing): the next
    # generation still runs version 5, and the step must stop rather than train on it
    real = engine.load_adapter
    engine.load_adapter = lambda tensors, config, version: {"seconds": 0.0}
    try:
        syncer(FakeActor(v1, 6), engine)
        stale = engine.generate(PROMPTS, _spec())
        with pytest.raises(StaleAdapterError, match="generated with adapter version 5, but the actor's "
                                                    "adapter version 6 was synced"):
            check_generated(stale, syncer)
    finally:
        engine.load_adapter = real


@pytest.mark.heavy
def test_engines_without_lora_slots_say_so(tiny_model):
    from verl_hpc.config.sections.lora import vllm_slot_rank

    assert [vllm_slot_rank(r) for r in (1, 2, 8, 9, 64)] == [1, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="rank 512 at most"):
        vllm_slot_rank(1000)
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.hf.engine import HFRollout

    hf_engine = HFRollout(tiny_model, **default_engine_args("hf", max_prompt_length=32, max_response_length=8))
    with pytest.raises(NotImplementedError, match="takes the merged weights"):
        hf_engine.load_adapter([], _config(), 1)
