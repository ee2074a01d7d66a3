"""The engines a generative judge runs on (verl_hpc/rewards/judge.py JudgeEngine); here, in the
rollout layer, because they are generation engines.

    engine = build_judge_engine(cfg, ctx)     # reward.reward_model.judge.engine: auto | vllm | hf

- VllmJudgeEngine: a second in-process vLLM engine beside the rollout's, one per rank (tensor
  parallel 1: a judge is a frozen model served whole), with judge.gpu_memory_utilization of the
  GPU and sleep mode on a GPU: it sleeps (its weights and KV cache released to the host / dropped)
  between the steps' scoring, so training has the memory.
- HFJudgeEngine: transformers' generate and forward (the fallback where vLLM is not installed, and
  the CPU default: a small judge's verdicts cost less than a vLLM start); on a GPU its weights move
  to the host while asleep.
Both decode greedily: a verdict is a function of its prompt, the same on every rank and rerun.
"""
from __future__ import annotations

import logging
import math
import os
from typing import List, Sequence

import torch

from verl_hpc.rewards.errors import RewardError
from verl_hpc.runtime import device as devices

log = logging.getLogger(__name__)


def _one_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise RewardError(f"the judge's tokenizer makes {text!r} {len(ids)} tokens; verdict = yes_no reads one "
                          "token's log-prob (reward.reward_model.judge.yes_token / no_token)")
    return int(ids[0])


class HFJudgeEngine:
    def __init__(self, path: str, *, trust_remote_code: bool = False, device=None, max_prompt_tokens: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "left"  # the next token of every row is the last column
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = torch.device(device) if device is not None else (
            devices.device_for(int(os.environ.get("LOCAL_RANK", 0))) if devices.has_gpu() else torch.device("cpu"))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        self.model.eval().requires_grad_(False)
        self.max_prompt_tokens = max_prompt_tokens
        self._home = self.device
        self.model.to(self.device)

    def token_id(self, text: str) -> int:
        return _one_token(self.tokenizer, text)

    def _encode(self, prompts: Sequence[str]):
        kw = dict(truncation=True, max_length=self.max_prompt_tokens) if self.max_prompt_tokens else {}
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True, **kw).to(self.device)
        # positions count real tokens only, so a left-padded row is computed as it would be alone
        enc["position_ids"] = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return enc

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], max_tokens: int) -> List[str]:
        enc = self._encode(prompts)
        enc.pop("position_ids")  # generate derives them from the attention mask
        out = self.model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                  pad_token_id=self.tokenizer.pad_token_id)
        return self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    @torch.no_grad()
    def next_token_logprobs(self, prompts: Sequence[str], token_ids: Sequence[int]) -> List[List[float]]:
        logits = self.model(**self._encode(prompts), use_cache=False).logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)[:, list(token_ids)]
        return logp.cpu().tolist()

    def sleep(self) -> None:
        if self._home.type == "cuda":
            self.model.to("cpu")

    def wake(self) -> None:
        if self._home.type == "cuda":
            self.model.to(self._home)


class VllmJudgeEngine:
    TOP_LOGPROBS = 20  # vLLM returns the top-k next tokens: a yes/no outside them has no mass here

    def __init__(self, path: str, *, trust_remote_code: bool = False, max_model_len: int = 2048,
                 gpu_memory_utilization: float, seed: int = 0, device=None):
        from verl_hpc.rollout import vllm_compat

        self.gpu = devices.has_gpu()
        device = device or (devices.device_for(int(os.environ.get("LOCAL_RANK", 0))) if self.gpu else torch.device("cpu"))
        kwargs = dict(model=str(path), dtype="auto" if self.gpu else "float32", seed=seed, tensor_parallel_size=1,
                      max_model_len=max_model_len, enforce_eager=not self.gpu, trust_remote_code=trust_remote_code)
        if self.gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:
            kwargs["kv_cache_memory_bytes"] = vllm_compat.cpu_kv_cache_bytes(path, max_model_len, 16)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.device = device
        with vllm_compat.engine_construction(device, tp=1):
            from vllm import LLM

            self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._asleep = False

    def token_id(self, text: str) -> int:
        return _one_token(self.tokenizer, text)

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

        from verl_hpc.rollout import vllm_compat

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


def build_judge_engine(reward_cfg, trust_remote_code: bool = False, max_model_len: int = 2048, seed: int = 0,
                       beside_vllm_rollout: bool = False):
    """The engine reward.reward_model.judge.engine names; auto: vLLM on a GPU where it is installed
    and the process runs no vLLM rollout, HF generate otherwise (JudgeConfig.uses_vllm says why)."""
    from verl_hpc.rollout.factory import vllm_available

    rm, judge = reward_cfg.reward_model, reward_cfg.reward_model.judge
    gpu = devices.has_gpu()
    if judge.engine == "vllm" and gpu and beside_vllm_rollout:
        raise RewardError("reward.reward_model.judge.engine = vllm beside this rank's vLLM rollout on a GPU: vLLM's "
                          "sleep-mode allocator and parallel state are one per process, so the rollout's sleep "
                          "would drop the judge's memory too; set judge.engine = hf (or auto, which picks it here)")
    if judge.uses_vllm(gpu, beside_vllm_rollout):
        if not vllm_available():
            raise RewardError("reward.reward_model.judge.engine = vllm but vllm is not installed; install it or "
                              "set judge.engine = hf")
        return VllmJudgeEngine(rm.path, trust_remote_code=trust_remote_code, max_model_len=max_model_len,
                               gpu_memory_utilization=judge.gpu_memory_utilization, seed=seed)
    return HFJudgeEngine(rm.path, trust_remote_code=trust_remote_code, max_prompt_tokens=max_model_len)
