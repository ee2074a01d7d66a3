"""vllm_compat: its targets are pinned for the installed vLLM release (a new release that moves one
fails here, by name; where the verified releases differ, each asserts its own: rollout/vllm/
versions.py), and each handler does what it says, without building an engine. `make test` runs it
on vLLM 0.32, `make test-vllm-range` on 0.25."""
import inspect
import mmap
import os
import random
import time

import numpy as np
import pytest
import torch

from verl_hpc.rollout.vllm import compat, versions

RELEASE = versions.release()


def test_the_installed_vllm_is_a_verified_release():
    import vllm

    installed = versions.parse(vllm.__version__)
    assert installed in {versions.parse(v) for v in versions.VERIFIED}, (
        f"vLLM {vllm.__version__} is not a release verl_hpc.rollout.vllm.compat was checked against "
        f"({', '.join(versions.VERIFIED)}): re-check every target in its docstring and the pins of this "
        "file, then add it to versions.RELEASES with what differs")
    assert versions.parse(versions.installed_version()) == installed  # the metadata the layer reads
    assert RELEASE.version == versions.nearest(vllm.__version__).version


def test_the_range_is_what_the_extras_and_installers_pin():
    assert compat.VERIFIED_VLLM_VERSION == versions.NEWEST.version == versions.RELEASES[-1].version
    assert [versions.parse(r.version) for r in versions.RELEASES] == sorted(
        versions.parse(r.version) for r in versions.RELEASES)


def test_shutdown_targets_are_where_the_guard_expects_them():
    from vllm.distributed import parallel_state
    from vllm.v1.engine import core, core_client

    assert callable(core.cleanup_dist_env_and_memory), "EngineCore's cleanup moved"
    assert "cleanup_dist_env_and_memory()" in inspect.getsource(core.EngineCore.shutdown), (
        "EngineCore.shutdown no longer calls core.cleanup_dist_env_and_memory: re-check hazard 1")
    assert "destroy_distributed_environment()" in inspect.getsource(
        parallel_state.cleanup_dist_env_and_memory)
    assert "torch.distributed.destroy_process_group()" in inspect.getsource(
        parallel_state.destroy_distributed_environment), "default-group teardown moved"
    # 0.32's in-process client shuts the engine down from a weakref finalizer too; 0.25's only on close()
    assert ("engine_core.shutdown" in inspect.getsource(core_client.InprocClient.__init__)) == RELEASE.gc_shutdown, (
        f"the in-process client's finalizer changed from vLLM {RELEASE.version}'s: close() and GC paths "
        "need re-checking")


def test_cpu_worker_targets():
    from vllm.distributed.device_communicators import cpu_communicator as cc
    from vllm.v1.worker import cpu_worker

    make = inspect.getattr_static(cc._CPUSHMDistributed, "make_group_name")
    assert isinstance(make, staticmethod), "make_group_name is no longer a staticmethod"
    if not getattr(make.__func__, "_verl_hpc_shm", False):  # unpatched: its source is vLLM's
        src = inspect.getsource(make.__func__)
        assert 'os.environ["VLLM_DIST_IDENT"]' in src and "cpushm" in src
    assert "make_group_name" in inspect.getsource(cc.CpuCommunicator._all_group_ranks_share_shm_group_name)
    init_device = inspect.getsource(cpu_worker.CPUWorker.init_device)
    assert "torch.set_num_threads = " in init_device, "hazard 3 moved or was fixed upstream"
    assert "set_random_seed" in init_device


def test_cpu_embedding_packs_its_weight_after_loading():
    """Hazard 6's cause: the CPU embedding/LM-head method packs the weight in its post-load step
    (test_rol_vllm_tied.py shows the stale head and the refresh end to end)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    src = inspect.getsource(UnquantizedEmbeddingMethod.process_weights_after_loading)
    assert "dispatch_cpu_unquantized_gemm" in src, "hazard 6 moved: check refresh_tied_lm_head"


def _vllm_setup_kernel():
    """vLLM's own UnquantizedFusedMoEMethod._setup_kernel, under handler 7's wrapper if installed."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    fn = UnquantizedFusedMoEMethod.__dict__["_setup_kernel"]
    return fn.__wrapped__ if getattr(fn, "_verl_hpc_moe_repack", False) else fn


def test_cpu_moe_reload_targets():
    """Hazard 7's cause, each piece where handler 7 expects it (test_rol_moe.py shows the stale
    reload and the fix end to end). If upstream starts repacking on a weight update, the wrapper
    would pack twice: this test fails first, by name. On 0.25 (no handler 7): its CPU experts repack
    in every post-load step, which the in-place reload runs."""
    if not RELEASE.moe_reload_repack:
        return _cpu_moe_repacks_on_every_load()
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.model_loader.reload import inplace, layerwise

    setup = inspect.getsource(_vllm_setup_kernel())
    assert "is_weight_update = self.moe_kernel is not None" in setup, "the weight-update test moved"
    skipped = setup.split("if not is_weight_update:", 1)
    assert len(skipped) == 2 and "self.moe_kernel.fused_experts.process_weights_after_loading(layer)" in skipped[1], (
        "vLLM no longer skips the experts' post-load step on a weight update: handler 7 (vllm_cpu_moe) "
        "would repack twice; check whether upstream fixed the stale reload and remove it")
    assert "self._setup_kernel(" in inspect.getsource(UnquantizedFusedMoEMethod.process_weights_after_loading)
    repack = inspect.getsource(cpu_moe.CPUUnquantizedExperts.process_weights_after_loading)
    assert "cpu_prepack_moe_weight" in repack and "_pad_moe_intermediate" in repack
    for isa in ("X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts", "PowerCPUUnquantizedExperts"):
        assert issubclass(getattr(cpu_moe, isa), cpu_moe.CPUUnquantizedExperts), isa
        assert "process_weights_after_loading" not in vars(getattr(cpu_moe, isa)), f"{isa} repacks its own way"
    assert "initialize_layerwise_reload(model)" in inspect.getsource(inplace.reload_weights)
    assert "quant_method.process_weights_after_loading(layer)" in inspect.getsource(layerwise._layerwise_process)
    assert "param.data.copy_(getattr(layer, name))" in inspect.getsource(layerwise._copy_and_restore_kernel_tensors)


def _cpu_moe_repacks_on_every_load():
    """vLLM 0.25: the CPU branch of the unquantized MoE method's post-load step builds its CPU kernel
    anew each time, and that build repacks the layer's weights; the in-place reload runs the step
    on the freshly loaded (checkpoint-order) weights and copies the result into the kernel tensors."""
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.v1.worker import gpu_model_runner

    post_load = inspect.getsource(UnquantizedFusedMoEMethod.process_weights_after_loading)
    cpu = post_load.split("elif self.unquantized_backend == UnquantizedMoeBackend.CPU:", 1)
    assert len(cpu) == 2, "the CPU branch of the MoE post-load step moved: re-check hazard 7"
    cpu_branch = cpu[1].split("elif self.unquantized_backend ==", 1)[0]
    assert "cpu_fused_moe.CPUFusedMOE(layer)" in cpu_branch and "is_weight_update" not in cpu_branch
    assert "self.init_moe_grouped_gemm(layer=layer)" in inspect.getsource(cpu_fused_moe.CPUFusedMOE.__init__)
    assert "cpu_prepack_moe_weight" in inspect.getsource(cpu_fused_moe.CPUFusedMOE.init_moe_grouped_gemm)
    assert "initialize_layerwise_reload(model)" in inspect.getsource(gpu_model_runner.GPUModelRunner.reload_weights)
    assert "quant_method.process_weights_after_loading(layer)" in inspect.getsource(layerwise._layerwise_process)
    assert "param.data.copy_(getattr(layer, name))" in inspect.getsource(layerwise._copy_and_restore_kernel_tensors)


def test_cpu_moe_repack_runs_on_updates_of_cpu_experts_only(monkeypatch):
    if not RELEASE.moe_reload_repack:  # 0.25: not installed at all
        from verl_hpc.rollout.vllm import cpu_moe as vllm_cpu_moe

        with compat.engine_construction(torch.device("cpu"), tp=1):
            pass
        assert vllm_cpu_moe.TARGET not in {r.target for r in compat.applied()} and not vllm_cpu_moe.installed()
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from verl_hpc.rollout.vllm import cpu_moe as vllm_cpu_moe

    class Experts(CPUUnquantizedExperts):
        def __init__(self):  # noqa: D107 - no vLLM config needed to count calls
            self.repacked = []

        def process_weights_after_loading(self, layer):
            self.repacked.append(layer)

    class Kernel:
        def __init__(self, experts):
            self.fused_experts = experts

    class Method:
        moe_kernel = None

    def upstream(self, layer, w13, w2):  # stands for vLLM's: builds the kernel on the first call
        if self.moe_kernel is None:
            self.moe_kernel = Kernel(self.experts)

    monkeypatch.setattr(UnquantizedFusedMoEMethod, "_setup_kernel", upstream)
    assert vllm_cpu_moe.install_cpu_moe_repack() and not vllm_cpu_moe.install_cpu_moe_repack()
    wrapped = UnquantizedFusedMoEMethod._setup_kernel
    assert wrapped.__wrapped__ is upstream and vllm_cpu_moe.installed()
    cpu, other = Method(), Method()
    cpu.experts, other.experts = Experts(), object()
    wrapped(cpu, "layer", None, None)  # first load: vLLM's own step packs
    assert cpu.experts.repacked == []
    wrapped(cpu, "layer", None, None)  # a reload: packed again
    wrapped(other, "layer", None, None)
    wrapped(other, "layer", None, None)  # not CPU experts: untouched
    assert cpu.experts.repacked == ["layer"]
    compat.install_cpu_moe_repack()
    assert vllm_cpu_moe.TARGET in {r.target for r in compat.applied()}


def test_vllms_groups_build_whatever_sys_stdout_is():
    """Handler 8 (vLLM 0.25): its suppress_stdout finds file descriptor 1 through sys.stdout, which an
    io.StringIO (captured output) does not have; 0.32's takes descriptor 1 itself, as the handler's does.
    The engine's construction installs it where 0.25's group code looks it up, and only on 0.25."""
    import contextlib
    import importlib
    import io

    from vllm.utils import system_utils

    from verl_hpc.rollout.vllm import stdout_fd

    assert ("sys.stdout.fileno()" in inspect.getsource(system_utils.suppress_stdout.__wrapped__)) == \
        RELEASE.stdout_fileno, f"vLLM {RELEASE.version}'s suppress_stdout changed: re-check handler 8"
    for name in stdout_fd.USERS:
        assert "suppress_stdout()" in inspect.getsource(importlib.import_module(name))
    with contextlib.redirect_stdout(io.StringIO()):
        with stdout_fd.suppress_stdout():
            os.write(1, b"")  # what gloo's group creation prints goes to /dev/null
        if RELEASE.stdout_fileno:
            with pytest.raises(io.UnsupportedOperation, match="fileno"):
                with system_utils.suppress_stdout():
                    pass
    with compat.engine_construction(torch.device("cpu"), tp=1):
        pass
    from vllm.distributed import parallel_state

    assert (parallel_state.suppress_stdout is stdout_fd.suppress_stdout) == RELEASE.stdout_fileno
    assert (stdout_fd.TARGET in {r.target for r in compat.applied()}) == RELEASE.stdout_fileno


def test_the_lora_loader_views_the_mapper_as_the_adapter_from_memory_does():
    """rollout/vllm/lora.py builds an adapter as vLLM's own worker manager loads one from a folder,
    with the model's mapper in the view that manager takes (0.25: unstacked, 0.32: renames only)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.model_executor.models.utils import WeightsMapper

    load = inspect.getsource(WorkerLoRAManager._load_adapter)
    assert f"hf_to_vllm_mapper.{RELEASE.lora_mapper}()" in load, load
    assert callable(getattr(WeightsMapper, RELEASE.lora_mapper))
    assert {"lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size", "weights_mapper",
            "skip_prefixes"} <= set(inspect.signature(LoRAModel.from_lora_tensors).parameters)


def test_the_draft_model_is_where_the_worker_keeps_it(monkeypatch):
    """rollout/vllm/worker.py: 0.32's worker hands its draft model out (`get_draft_model`); 0.25's has
    no such method, and its model runner's proposer (`drafter`) holds the draft model as `model`."""
    import dataclasses
    from types import SimpleNamespace

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.cpu_worker import CPUWorker

    from verl_hpc.rollout.vllm import worker as vllm_worker

    assert callable(getattr(CPUWorker, "get_draft_model", None)) == RELEASE.worker_draft_getter
    assert "self.drafter = DraftModelProposer(" in inspect.getsource(gpu_model_runner.GPUModelRunner)
    assert "self.model = self._get_model()" in inspect.getsource(SpecDecodeBaseProposer.load_model)
    model = object()
    worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=SimpleNamespace(model=model)),
                             get_draft_model=lambda: model)
    for getter in (True, False):
        release = dataclasses.replace(RELEASE, worker_draft_getter=getter)
        monkeypatch.setattr(versions, "release", lambda version=None, r=release: r)
        assert vllm_worker.draft_model(worker) is model
    assert vllm_worker.draft_model(SimpleNamespace(model_runner=SimpleNamespace())) is None  # n-gram: no model


def test_weight_update_api_is_there():
    from vllm import LLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in ("collective_rpc", "apply_model", "reset_prefix_cache", "sleep", "wake_up",
                 "generate"):
        assert callable(getattr(LLM, name)), name
    params = inspect.signature(GPUModelRunner.reload_weights).parameters
    assert {"weights_iterator", "is_checkpoint_format"} <= set(params)
    from vllm.config.model import LogprobsMode

    assert {"processed_logprobs", "raw_logprobs"} <= set(LogprobsMode.__args__)


def test_shutdown_guard_is_installed_once():
    from vllm.v1.engine import core

    compat.install_shutdown_guard()
    first = core.cleanup_dist_env_and_memory
    compat.install_shutdown_guard()
    assert core.cleanup_dist_env_and_memory is first and first._verl_hpc_guard
    assert compat.SHUTDOWN_TARGET in {r.target for r in compat.applied()}


def test_destroy_is_skipped_only_for_the_protected_default_group(monkeypatch):
    import torch.distributed as dist

    calls, world = [], object()
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append(group))
    monkeypatch.setattr(compat, "_default_group", lambda: world)
    monkeypatch.setattr(compat, "_protected_groups", [world])
    sub = object()
    with compat._default_group_kept():
        dist.destroy_process_group()  # the trainer's default group: kept
        dist.destroy_process_group(world)
        dist.destroy_process_group(sub)  # a group vLLM made: destroyed
    assert calls == [sub]
    monkeypatch.setattr(compat, "_protected_groups", [])
    with compat._default_group_kept():
        dist.destroy_process_group()  # vLLM's own default group (no trainer group): destroyed
    assert calls == [sub, None]


def test_preserved_rng():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with compat.preserved_rng(torch.device("cpu")):
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        torch.rand(100)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_torch_threads_kept():
    real, threads = torch.set_num_threads, torch.get_num_threads()
    with compat.torch_threads_kept():
        torch.set_num_threads = lambda n: None  # what vLLM's CPU worker does
    assert torch.set_num_threads is real and torch.get_num_threads() == threads


def test_job_token():
    assert compat.job_token({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4", "MASTER_PORT": "1"}) == \
        "verlhpc-slurm123.4"
    assert compat.job_token({"MASTER_ADDR": "node:7", "MASTER_PORT": "29500"}) == "verlhpc-node_7-29500"
    assert compat.job_token({}).startswith("verlhpc-pid")


def test_shm_names_get_the_job_token(monkeypatch):
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    class Comm:
        unique_name, ranks = "tp:0", [0, 1]

    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what env:// gives (external launcher)
    monkeypatch.setattr(compat, "_shm_token", compat._shm_token)
    compat.install_shm_names("verlhpc-slurm9.0")
    assert _CPUSHMDistributed.make_group_name(Comm()) == "verlhpc-slurm9.0_-tp:0-[0-1]-cpushm"
    compat.install_shm_names("verlhpc-other")  # a second install only changes the token
    assert _CPUSHMDistributed.make_group_name(Comm()).startswith("verlhpc-other_-tp:0")


def test_stale_shm_cleanup(tmp_path):
    now = time.time()
    names = {"stale": "-tp:0-[0-1]-cpushm_0", "young": "verlhpc-b_-tp:0-[0-1]-cpushm_1",
             "own": "verlhpc-a_-tp:0-[0-1]-cpushm_0", "mapped": "verlhpc-c_-tp:0-[0-1]-cpushm_0",
             "other": "psm_1234"}
    for key, name in names.items():
        path = tmp_path / name
        path.write_bytes(b"\0" * 4096)
        if key != "young":
            os.utime(path, (now - 3600, now - 3600))
    with open(tmp_path / names["mapped"], "r+b") as f, mmap.mmap(f.fileno(), 4096):
        removed = compat.remove_stale_shm("verlhpc-a", shm_dir=tmp_path, now=now)
    assert removed == [names["stale"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("young", "own", "mapped", "other"))


def test_cpu_kv_cache_bytes(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 512, '
        '"num_hidden_layers": 6}')
    # 2 (K,V) * 6 layers * 4 heads * 64 dims * 4 bytes = 12 KiB per token; 160 -> 256 tokens, and
    # vLLM's null block
    assert compat.cpu_kv_cache_bytes(str(tmp_path), 160, 256) == 12 * 1024 * (256 * 256 + 128)
    assert compat.cpu_kv_cache_bytes(str(tmp_path), 16, 1) == 32 << 20  # floor


def test_reload_noise_filter_drops_only_the_per_update_lines():
    import logging

    compat.quiet_reload_logs()
    compat.quiet_reload_logs()  # idempotent
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert sum(isinstance(f, compat._ReloadNoise) for f in layerwise.filters) == 1

    def passes(msg, *args):
        record = logging.LogRecord("vllm", logging.WARNING, "f.py", 1, msg, args, None)
        return layerwise.filter(record)

    assert not passes("Reloading and processing weights took %.2f seconds", 0.01)
    assert not passes("Successfully reset prefix cache")
    assert not passes("%s: Failed to load weights", "RotaryEmbedding")
    assert passes("%s: Failed to load weights", "QKVParallelLinear")  # a real failure still shows
    assert passes("something else")


def test_reload_noise_messages_are_vllms():
    import importlib

    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.v1.core import block_pool

    timing = importlib.import_module(RELEASE.reload_timing_logger)  # reload/inplace.py in 0.32, the runner in 0.25
    assert "Reloading and processing weights took" in inspect.getsource(timing)
    assert '"%s: Failed to load weights"' in inspect.getsource(layerwise)
    assert '"Successfully reset prefix cache"' in inspect.getsource(block_pool)
    for mod in (timing, layerwise, block_pool):
        assert mod.logger.name in compat.RELOAD_LOGGERS


def test_a_failed_construction_releases_vllms_groups(monkeypatch):
    """vllm.LLM(...) raising half-way leaves vLLM's groups registered: they are released through the
    guarded cleanup (the trainer's default group stays) and the construction error goes on."""
    from vllm.v1.engine import core

    calls = []

    def cleanup(*args, **kwargs):
        calls.append("cleanup")

    cleanup._verl_hpc_guard = True  # stands for the installed guard
    monkeypatch.setattr(core, "cleanup_dist_env_and_memory", cleanup)
    with compat.engine_construction(torch.device("cpu"), tp=1):
        pass
    assert calls == []  # a built engine is shut down by close(), not here
    with pytest.raises(ValueError, match="weights do not fit"):
        with compat.engine_construction(torch.device("cpu"), tp=1):
            raise ValueError("weights do not fit")
    assert calls == ["cleanup"]


@pytest.mark.parametrize("around", ["construction", "call"])
def test_a_build_or_reload_that_raises_leaves_the_default_dtype_as_it_was(monkeypatch, around):
    """vLLM's model loader sets the default dtype to the model's while it builds or reloads; 0.25's
    setter restores it only on success, so an engine that failed to build left a job (an HF rollout
    fallback, the trainer's next tensors) in bfloat16. Each entry point puts it back."""
    from vllm.v1.engine import core

    monkeypatch.setattr(core, "cleanup_dist_env_and_memory", lambda *a, **k: None)
    guard = (compat.engine_construction(torch.device("cpu"), tp=1) if around == "construction"
             else compat.engine_call(torch.device("cpu")))
    with pytest.raises(RuntimeError, match="exceeds dimension size"):
        with guard:
            torch.set_default_dtype(torch.bfloat16)  # what 0.25's setter leaves when the build raises
            raise RuntimeError("start (0) + length (512) exceeds dimension size (256).")
    assert torch.get_default_dtype() == torch.float32


def test_an_engine_call_from_another_thread_takes_torchs_thread_count():
    """OpenMP keeps its thread count per thread: a thread started after torch.set_num_threads(1)
    begins at the machine's default, and vLLM's CPU attention then planned with one count and ran
    with the other (the agent endpoint's engine thread, under make test's one-thread workers)."""
    import ctypes
    import threading

    # torch's own OpenMP runtime (other wheels bring copies of their own: sentencepiece's, ...)
    libs = {p for p in open("/proc/self/maps").read().split() if "libgomp" in p and "/torch/lib/" in p}
    assert len(libs) == 1, f"torch's OpenMP runtime (libgomp) not found among the mapped files: {libs}"
    omp = ctypes.CDLL(libs.pop())
    before = torch.get_num_threads()
    seen = {}

    def engine_thread():
        seen["fresh"] = omp.omp_get_max_threads()
        compat.this_thread_threads(torch.device("cpu"))
        seen["after"] = omp.omp_get_max_threads()

    torch.set_num_threads(1)
    try:
        t = threading.Thread(target=engine_thread)
        t.start(), t.join()
    finally:
        torch.set_num_threads(before)
    assert seen["after"] == 1, seen
    if (os.cpu_count() or 1) > 1 and "OMP_NUM_THREADS" not in os.environ:
        assert seen["fresh"] > 1, seen  # the hazard itself: a fresh thread starts at the default
