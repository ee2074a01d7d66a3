"""The peers of benchmarks/bench_gpu_step.py, one interface with its engine sides (gpu_step_sides.py):
`HFSide` (plain transformers, as TRL / accelerate train it) and `HFLigerSide` (transformers with
Liger-Kernel, as TRL's `use_liger_kernel` runs it: the peer to beat)."""
from __future__ import annotations

import contextlib
import gc

import torch

from gpu_step_sides import _qual, swiglu_kind


class HFSide:
    """LlamaForCausalLM as TRL / accelerate train it: fp32 weights, bf16 autocast on a GPU (none in
    the fp32 rehearsal), SDPA attention, fused AdamW with the actor's optimizer settings."""

    LIGER = False

    def __init__(self, folder, shape, dtype: str, device):
        from transformers import AutoModelForCausalLM

        from verl_hpc.engines.options import default_options

        optim = default_options(str(folder)).optim  # the engine's actor.optim, so both step alike
        self.device = device
        self.autocast_dtype = None if dtype == "float32" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa").to(device)
        self._liger_scope = None
        if self.LIGER:  # as TRL applies it (RoPE too); put back at close(): later sides keep transformers' own
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            from verl_hpc.engines.fsdp.liger import modeling_modules_kept

            self._liger_scope = modeling_modules_kept(self.model)
            self._liger_scope.__enter__()
            _apply_liger_kernel_to_instance(model=self.model, rms_norm=True, swiglu=True, rope=True,
                                            cross_entropy=False, fused_linear_cross_entropy=False)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # as transformers' Trainer: no weight decay on biases and norm weights (1-D tensors)
        groups = [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": optim.weight_decay},
                  {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                     fused=True)
        self.clip = optim.clip_grad

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _log_probs(self, batch):
        prompt = int(batch["prompt_lengths"][0])
        if not bool((batch["prompt_lengths"] == prompt).all()):
            raise ValueError("the transformers side takes prompts of one length")
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        keep = ids.shape[1] - prompt + 1  # the positions that predict a response token
        if self.LIGER:  # the hidden states of those positions into Liger's fused linear cross-entropy
            from verl_hpc.engines.fsdp.liger import liger_log_probs

            with self._autocast():
                hidden = self.model.model(ids, use_cache=False).last_hidden_state[:, prompt - 1:-1]
                return liger_log_probs(hidden, self.model.lm_head.weight, ids[:, prompt:], 1.0)
        with self._autocast():
            # no KV cache: nothing is generated (a cache would only keep K and V alive longer)
            logits = self.model(ids, logits_to_keep=keep, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(-1, ids[:, prompt:, None]).squeeze(-1)

    def train(self, batch) -> float:
        from gpu_step_diag import OPTIMIZER_RANGE

        loss = -self._log_probs(batch).mean()
        loss.backward()
        with torch.profiler.record_function(OPTIMIZER_RANGE):  # the optimizer phase, for the kernel profile
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def forward(self, batch):
        self.model.eval()
        try:
            with torch.no_grad():
                return self._log_probs(batch)
        finally:
            self.model.train()

    def kernels(self) -> dict:
        layer = self.model.model.layers[0]
        norm = layer.input_layernorm
        return {
            "attention": f"{self.model.config._attn_implementation} (transformers' attention interface)",
            "norm": f"{_qual(type(norm))} ({norm._get_name()})",
            "swiglu": swiglu_kind(layer.mlp),
            "output layer": ("Liger's fused linear cross-entropy on the response positions' hidden states"
                             if self.LIGER else "the response positions' logits (logits_to_keep), log_softmax"),
            "precision": "fp32 weights" + (f", {self.autocast_dtype} autocast" if self.autocast_dtype else ""),
            "optimizer": f"{_qual(type(self.opt))} (fused={self.opt.param_groups[0].get('fused')})",
        }

    def close(self) -> None:
        if self._liger_scope is not None:
            self._liger_scope.__exit__(None, None, None)
        self.model = self.opt = self.params = None
        gc.collect()


class HFLigerSide(HFSide):
    """The peer to beat: transformers with Liger-Kernel as TRL's `use_liger_kernel` runs it (Liger's
    RMSNorm, SwiGLU and RoPE patched into the model, the log-probs from its fused linear
    cross-entropy on the hidden states), the rest as the transformers side."""
    LIGER = True
