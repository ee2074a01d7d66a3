"""LoRA adapters handed to vLLM from memory, without a folder: the adapter sync's last step
(VLLMRollout.load_adapter, through `LLM.collective_rpc`). Verified against vLLM 0.25.0 and 0.32.0
(tests/unit/rollout/test_rol_vllm_lora.py: the adapter's log-probs equal PEFT's)."""
from __future__ import annotations

import time

from verl_hpc.rollout.vllm import versions


def load_adapter(llm, tensors, peft_config: dict, version: int, old):
    """((LoRARequest, version), figures): the adapter built from `tensors` in every worker and
    registered under id version + 1, `old` removed first so that nothing can serve it."""
    from vllm.lora.request import LoRARequest

    start = time.perf_counter()
    tensors = {name: t.detach().to("cpu", copy=True) for name, t in tensors}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    llm.collective_rpc(install_lora_adapter, args=(tensors, dict(peft_config), version + 1, old))
    # the path is never read: the adapter is registered before any request names it
    request = LoRARequest(lora_name=f"policy-v{version}", lora_int_id=version + 1,
                          lora_path=f"in-memory://policy/v{version}")
    return (request, version), dict(tensors=len(tensors), bytes=nbytes, seconds=time.perf_counter() - start)


def install_lora_adapter(worker, tensors, peft_config: dict, lora_id: int, old_id) -> list:
    """Run in vLLM's worker (LLM.collective_rpc): register the adapter built from `tensors` under
    `lora_id`, after removing `old_id`. vLLM (0.25, 0.32) loads adapters only from a folder, inside its
    worker's LoRA manager (WorkerLoRAManager._load_adapter); this builds the same LoRAModel with its
    own `from_lora_tensors`, validated by its PEFTHelper, with the model's mapper as that manager
    views it (versions.Release.lora_mapper), and hands it to the same adapter manager.
    A request naming `lora_id` then finds it registered and never reads its path. Returns the
    registered ids, for the caller's check."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict(dict(peft_config, vllm_max_position_embeddings=manager.max_position_embeddings))
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=getattr(mapper, versions.release().lora_mapper)() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    if old_id is not None:
        manager.remove_adapter(old_id)
    if lora_id in manager.list_adapters():
        manager.remove_adapter(lora_id)
    adapters.add_adapter(lora)
    return sorted(manager.list_adapters())
