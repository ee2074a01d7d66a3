"""`VllmJudgeEngine`: a generative judge (verl_hpc/rewards/judge.py) on a second in-process vLLM
engine beside the rollout's, one per rank (tensor parallel 1: a judge is a frozen model served
whole), with judge.gpu_memory_utilization of the GPU and sleep mode on a GPU: it sleeps (its weights
and KV cache released to the host / dropped) between the steps' scoring, so training has the memory.
It decodes greedily, as the HF judge does."""
from __future__ import annotations

import logging
import math
import os
from typing import List, Sequence

import torch

from verl_hpc.rollout.hf.judge import verdict_token_id
from verl_hpc.runtime import device as devices

log = logging.getLogger(__name__)


class VllmJudgeEngine:
    TOP_LOGPROBS = 20  # vLLM returns the top-k next tokens: a yes/no outside them has no mass here

    def __init__(self, path: str, *, trust_remote_code: bool = False, max_model_len: int = 2048,
                 gpu_memory_utilization: float, seed: int = 0, device=None):
        from verl_hpc.rollout.vllm import compat as vllm_compat

        self.gpu = devices.has_gpu()
        device = device or (devices.device_for(int(os.environ.get("LOCAL_RANK", 0))) if self.gpu else torch.device("cpu"))
        kwargs = dict(model=str(path), dtype="auto" if self.gpu else "float32", seed=seed, tensor_parallel_size=1,
                      max_model_len=max_model_len, enforce_eager=not self.gpu, trust_remote_code=trust_remote_code)
        if self.gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:
            kwargs["kv_cache_memory_bytes"] = vllm_compat.cpu_kv_cache_bytes(path, max_model_len, 16)
        self.device = device
        with vllm_compat.engine_construction(device, tp=1):
            from vllm import LLM

            self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._asleep = False

    def token_id(self, text: str) -> int:
        return verdict_token_id(self.tokenizer, text)

    def generate(self, prompts: Sequence[str], max_tokens: int) -> List[str]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return [o.outputs[0].text for o in self.llm.generate(list(prompts), params, use_tqdm=False)]

    def next_token_logprobs(self, prompts: Sequence[str], token_ids: Sequence[int]) -> List[List[float]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=self.TOP_LOGPROBS)
        out = []
        for o in self.llm.generate(list(prompts), params, use_tqdm=False):
            top = o.outputs[0].logprobs[0]
            out.append([float(top[t].logprob) if t in top else -math.inf for t in token_ids])
        return out

    def sleep(self) -> None:
        if self.gpu and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self.gpu and self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down (its own process groups go; the job's default group stays)."""
        import gc

        from verl_hpc.rollout.vllm import compat as vllm_compat

        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            with vllm_compat.engine_call(self.device):
                llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - a failed shutdown at the end must not hide the job's result
            log.warning("vllm judge: engine shutdown failed (%s: %s)", type(e).__name__, e)
        del llm
        gc.collect()
