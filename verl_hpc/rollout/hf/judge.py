"""`HFJudgeEngine`: a generative judge (verl_hpc/rewards/judge.py) on transformers' generate and
forward: the fallback where vLLM is not installed, and the CPU default (a small judge's verdicts cost
less than a vLLM start); on a GPU its weights move to the host while asleep. It decodes greedily: a
verdict is a function of its prompt, the same on every rank and rerun. `factory.build_judge_engine`
chooses between it and vllm/judge.py's engine."""
from __future__ import annotations

import os
from typing import List, Sequence

import torch

from verl_hpc.rewards.errors import RewardError
from verl_hpc.runtime import device as devices


def verdict_token_id(tokenizer, text: str) -> int:
    """The one token a yes/no verdict reads; both judge engines ask it of their tokenizer."""
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
        return verdict_token_id(self.tokenizer, text)

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
