"""rollout.speculative: off by default; each method the engine or model cannot take is refused
before the queue with one line naming the field; the section -> vLLM's speculative_config; the
auto rule; the HF rollout refuses by name."""
import functools
import json

import pytest
import torch
from safetensors.torch import save_file

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.sections.speculative import SpeculativeConfig, parse_schedule
from verl_hpc.rollout.speculative import config as speculative
from verl_hpc.rollout.speculative.config import auto_choice, refuse_on_hf, vllm_speculative_config

import config_checks

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "rollout.n=2"]
S = "rollout.speculative."


problems = functools.partial(config_checks.found, base=BASE)  # [] when validate accepts them


def test_off_by_default_and_a_plain_ngram_job_passes():
    assert load_config(None, BASE).rollout.speculative.method == "off"
    assert problems(f"{S}method=ngram", f"{S}schedule=[1-8:4,9-256:0]") == []
    assert problems(f"{S}method=auto", "rollout.engine=hf") == []  # auto is off on HF, said in the log


@pytest.mark.parametrize("overrides, wanted", [
    ([f"{S}method=ngram", "rollout.engine=hf"], "rollout.speculative.method = ngram needs rollout.engine = vllm"),
    ([f"{S}method=ngram", "rollout.engine=fastest"], "with rollout.engine = fastest on a CPU job"),
    ([f"{S}method=mtp"], "rollout.speculative.method = mtp on a CPU job"),
    ([f"{S}method=suffix"], "rollout.speculative.method = suffix needs the arctic-inference package"),
    ([f"{S}method=draft_model"], "rollout.speculative.method = draft_model needs rollout.speculative.draft_model_path"),
    ([f"{S}method=ngram", f"{S}draft_model_path=/x"], "rollout.speculative.draft_model_path is set but method = ngram"),
    ([f"{S}method=ngram", f"{S}prompt_lookup_min=4"], "rollout.speculative.prompt_lookup_min = 4 exceeds"),
    ([f"{S}method=ngram", f"{S}prompt_lookup_max=1000000000"],
     "rollout.speculative.prompt_lookup_max = 1000000000 exceeds the longest suffix the n-gram proposer can match"),
    ([f"{S}method=auto", f"{S}prompt_lookup_min=5000", f"{S}prompt_lookup_max=5000", "data.max_prompt_length=64",
      "data.max_response_length=64"], "rollout.speculative.prompt_lookup_min = 5000 exceeds the longest suffix"),
    ([f"{S}method=ngram", f"{S}num_speculative_tokens=0"], "rollout.speculative.num_speculative_tokens: must be in"),
    ([f"{S}method=ngram", f"{S}schedule=[2-8:4]"], "rollout.speculative.schedule: the first range must start at 1"),
    ([f"{S}method=ngram", f"{S}schedule=[1-8:4,8-9:2]"], "rollout.speculative.schedule: the ranges overlap at 8"),
    ([f"{S}method=ngram", f"{S}schedule=[1-8:9]"], "K = 9 in '1-8:9' exceeds num_speculative_tokens = 4"),
    ([f"{S}method=ngram", f"{S}schedule=[eight]"], "rollout.speculative.schedule[0] = 'eight': must be 'LO-HI:K'"),
    ([f"{S}method=auto", f"{S}schedule=[1-8:4]"], "rollout.speculative.schedule is set with method = auto"),
    ([f"{S}method=nrgam"], "did you mean 'ngram'"),
    ([f"{S}method=ngram", f"{S}draft_layers=1"], "rollout.speculative.draft_layers = 1 needs rollout.speculative."
                                                 "method = draft_model (got ngram)"),
    ([f"{S}method=draft_model", f"{S}draft_layers=1", f"{S}draft_model_path=/x"],
     "rollout.speculative.draft_layers = 1 and rollout.speculative.draft_model_path are both set"),
    ([f"{S}method=draft_model", f"{S}draft_layers=1", "rollout.tp=2"],
     "rollout.speculative.draft_layers = 1 with rollout.tp = 2"),
    ([f"{S}method=draft_model", f"{S}draft_layers=1", "lora.rank=8", "lora.sync=adapter"],
     "rollout.speculative.draft_layers = 1 with the LoRA adapter sync"),
])
def test_each_refusal_names_its_field(overrides, wanted):
    if "suffix" in " ".join(overrides) and speculative.arctic_inference_installed():
        pytest.fail("arctic-inference is installed here: this refusal cannot be shown")
    try:
        found = problems(*overrides)
    except ConfigError as e:  # a bad choice is refused while loading
        found = e.problems
    assert any(wanted in p for p in found), found


def _folder(path, weights=True, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if weights:  # a placeholder tensor: the checks read the folder's config and its files' kinds
        save_file({"w": torch.zeros(1)}, str(path / "model.safetensors"))
    return str(path)


def test_folder_checks_mtp_layers_and_the_draft_models_vocabulary(tmp_path):
    """Read from the model folders (validate's model step): MTP needs the policy's MTP layers; a draft
    model must share the policy's vocabulary."""
    policy = _folder(tmp_path / "policy", model_type="llama", vocab_size=500)
    cfg = load_config(None, [*BASE, f"model.path={policy}", f"{S}method=mtp", "slurm.gpus_per_node=1"])
    assert "has no multi-token-prediction layers" in cfg.rollout.speculative.folder_problems(cfg)[0]
    mtp = _folder(tmp_path / "mtp", model_type="deepseek_v3", vocab_size=500, num_nextn_predict_layers=1)
    cfg.model.path = mtp
    assert cfg.rollout.speculative.folder_problems(cfg) == []
    other = _folder(tmp_path / "draft", model_type="llama", vocab_size=800)
    cfg = load_config(None, [*BASE, f"model.path={policy}", f"{S}method=draft_model", f"{S}draft_model_path={other}"])
    assert "has vocab_size 800, the policy (model.path) 500" in cfg.rollout.speculative.folder_problems(cfg)[0]
    # the drafter is re-sent from its safetensors after every sync: a folder of .bin files only is refused
    old = _folder(tmp_path / "draft_bin", weights=False, model_type="llama", vocab_size=500)
    torch.save({"w": torch.zeros(1)}, f"{old}/pytorch_model.bin")
    cfg.rollout.speculative.draft_model_path = old
    assert "holds no *.safetensors file" in cfg.rollout.speculative.folder_problems(cfg)[0]
    save_file({"w": torch.zeros(1)}, f"{old}/model.safetensors")
    assert cfg.rollout.speculative.folder_problems(cfg) == []
    cfg.rollout.speculative.draft_model_path = str(tmp_path / "missing")
    assert "no readable config.json" in cfg.rollout.speculative.folder_problems(cfg)[0]


def test_a_drafter_of_the_policys_first_layers_passes_alone_and_is_checked_against_the_folder(tmp_path):
    """draft_layers: no draft_model_path needed; N within the policy's layers; the plain decoder
    layout (the tensors the sync picks out by name), anything else refused by name."""
    from verl_hpc.config.sections.speculative import drafter_names, drafter_problems

    assert problems(f"{S}method=draft_model", f"{S}draft_layers=1") == []
    plain = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
             *(f"model.layers.{i}.mlp.up_proj.weight" for i in range(4))}
    config = dict(model_type="llama", num_hidden_layers=4)
    assert drafter_problems(config, plain, 3) == []
    assert drafter_names(plain, 2) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                                       "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    assert "must be in [1, 3] (the policy has 4 decoder layers)" in drafter_problems(config, plain, 4)[0]
    gpt2 = {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"}
    assert "not the plain decoder layout" in drafter_problems(config, gpt2, 1)[0]
    vision = dict(model_type="qwen2_5_vl", text_config=dict(num_hidden_layers=4))
    assert "no top-level num_hidden_layers" in drafter_problems(vision, plain, 1)[0]
    four = _folder(tmp_path / "four", model_type="llama", vocab_size=500, num_hidden_layers=4)
    cfg = load_config(None, [*BASE, f"model.path={four}", f"{S}method=draft_model", f"{S}draft_layers=4"])
    assert "must be in [1, 3]" in cfg.rollout.speculative.folder_problems(cfg)[0]
    cfg.rollout.speculative.draft_layers = 2  # a folder without safetensors: no model.layers.<i>. tensors
    assert "not the plain decoder layout" in cfg.rollout.speculative.folder_problems(cfg)[0]
    with pytest.raises(ConfigError, match="the engine writes the drafter's folder"):
        vllm_speculative_config(SpeculativeConfig(method="draft_model", draft_layers=1), model_path="/m", gpu=False)
    got = vllm_speculative_config(SpeculativeConfig(method="draft_model", draft_layers=1), model_path="/m",
                                  gpu=False, drafter="/scratch/drafter")
    assert got == dict(method="draft_model", num_speculative_tokens=4, model="/scratch/drafter")


def test_vllm_speculative_config_from_the_section(tmp_path):
    path = _folder(tmp_path / "m", model_type="llama", vocab_size=500)
    assert vllm_speculative_config(None, model_path=path, gpu=False) is None
    assert vllm_speculative_config(SpeculativeConfig(), model_path=path, gpu=False) is None
    s = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=5, schedule=["9-16:0", "1-8:3"])
    assert vllm_speculative_config(s, model_path=path, gpu=False) == dict(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=5,
        num_speculative_tokens_per_batch_size=[[1, 8, 3], [9, 16, 0]])
    draft = _folder(tmp_path / "d", model_type="llama", vocab_size=500)
    s = SpeculativeConfig(method="draft_model", draft_model_path=draft)
    assert vllm_speculative_config(s, model_path=path, gpu=False)["model"] == draft
    with pytest.raises(ConfigError, match="method = mtp on a machine without a GPU"):
        vllm_speculative_config(SpeculativeConfig(method="mtp"), model_path=path, gpu=False)
    with pytest.raises(ConfigError, match="has no multi-token-prediction layers"):
        vllm_speculative_config(SpeculativeConfig(method="mtp"), model_path=path, gpu=True)


def test_auto_follows_the_measured_rule_and_says_why(tmp_path, caplog):
    """n-gram in multi-turn episodes on CPU at the measured sizes, with a schedule that stops it above
    the measured concurrency; off for single-turn jobs, smaller or unknown models and on GPUs; the
    choice logged once; a job's multi_turn switch reaches the engine (trainer/roles.py's options)."""
    big, small = speculative.AUTO_MIN_PARAMS, speculative.AUTO_MIN_PARAMS - 1
    for gpu, episodes, params in ((False, False, big), (True, True, big), (False, True, small), (False, True, None)):
        assert auto_choice(gpu, episodes, params)[0] == "off", (gpu, episodes, params)
    method, why = auto_choice(False, True, big)
    assert method == "ngram" and f"<= {speculative.AUTO_MAX_CONCURRENCY} sequences" in why
    path = _folder(tmp_path / "m", model_type="llama", vocab_size=500)
    auto = SpeculativeConfig(method="auto")
    with caplog.at_level("INFO", logger="verl_hpc.rollout.speculative.config"):
        got = vllm_speculative_config(auto, model_path=path, gpu=False, episodes=True, params=big)
        vllm_speculative_config(auto, model_path=path, gpu=False, episodes=True, params=big)
    c = speculative.AUTO_MAX_CONCURRENCY
    assert got["num_speculative_tokens_per_batch_size"] == [[1, c, speculative.AUTO_TOKENS],
                                                            [c + 1, speculative.VLLM_MAX_SEQS, 0]]
    assert got["method"] == "ngram" and got["num_speculative_tokens"] == speculative.AUTO_TOKENS
    assert sum("method = auto: ngram" in r.getMessage() for r in caplog.records) == 1  # once
    assert vllm_speculative_config(auto, model_path=path, gpu=False, episodes=True, params=small) is None
    assert vllm_speculative_config(auto, model_path=path, gpu=False, episodes=False, params=big) is None
    from verl_hpc.rollout.engine_config import engine_kwargs
    from verl_hpc.trainer.roles import rollout_options

    for episodes in (False, True):
        cfg = load_config(None, [*BASE, f"multi_turn.enable={str(episodes).lower()}"])
        assert engine_kwargs(rollout_options(cfg), "vllm")["episodes"] is episodes


def test_the_hf_rollout_refuses_by_name_and_takes_auto_as_off():
    refuse_on_hf(None), refuse_on_hf(SpeculativeConfig()), refuse_on_hf(SpeculativeConfig(method="auto"))
    with pytest.raises(ConfigError, match="rollout.speculative.method = ngram needs rollout.engine = vllm"):
        refuse_on_hf(SpeculativeConfig(method="ngram"))


def test_schedule_parsing():
    assert parse_schedule([" 1 - 4 : 2", "5-9:0"]) == ([(1, 4, 2), (5, 9, 0)], [])
    assert parse_schedule([]) == ([], [])
    assert "1 <= LO <= HI" in parse_schedule(["5-1:2"])[1][0]
