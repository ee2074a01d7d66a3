"""The engine choice (parallel.engine, choose_engine) and the fsdp section's checks: what auto picks
per model folder, and the combinations refused before the queue with one line naming the fields."""
import json

import pytest

from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.config.schema import ParallelConfig
from verl_hpc.config.sections.fsdp import FsdpConfig, choose_engine
from verl_hpc.engines.fsdp.build import check_compile


def _folder(tmp_path, name, architecture, **extra):
    folder = tmp_path / name
    folder.mkdir()
    cfg = dict(architectures=[architecture], model_type=architecture.replace("ForCausalLM", "").lower(),
               vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **extra)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.fixture
def folders(tmp_path):
    return {"mapped": _folder(tmp_path, "llama", "LlamaForCausalLM"),
            "unmapped": _folder(tmp_path, "olmo2", "Olmo2ForCausalLM")}


def test_auto_picks_megatron_only_for_a_mapped_model_with_model_parallelism(folders):
    plain, tp2, pp2 = ParallelConfig(), ParallelConfig(tp=2), ParallelConfig(pp=2)
    assert choose_engine("auto", folders["mapped"], plain) == "fsdp"
    assert choose_engine("auto", folders["mapped"], tp2) == "megatron"
    assert choose_engine("auto", folders["mapped"], pp2) == "megatron"
    assert choose_engine("auto", folders["unmapped"], plain) == "fsdp"
    with pytest.raises(ConfigError, match=r"parallel.engine = auto: critic.model_path: Olmo2ForCausalLM is "
                                          r"not mapped into Megatron.*parallel.tp = 2"):
        choose_engine("auto", folders["unmapped"], tp2, "critic.model_path")


def test_an_explicit_engine_is_taken_as_written(folders):
    assert choose_engine("fsdp", folders["mapped"], ParallelConfig(tp=2)) == "fsdp"  # the section refuses tp
    assert choose_engine("megatron", folders["unmapped"], ParallelConfig()) == "megatron"  # Megatron's mapping refuses
    with pytest.raises(ConfigError, match="parallel.engine = 'deepspeed'; valid: auto, megatron, fsdp"):
        choose_engine("deepspeed", folders["mapped"], ParallelConfig())


@pytest.mark.parametrize("override, words", [
    ("parallel.pp=2", "parallel.engine = fsdp with parallel.pp = 2: FSDP has no pipeline parallelism"),
    ("parallel.ep=2", "parallel.engine = fsdp with parallel.ep = 2: FSDP has no expert parallelism"),
    ("parallel.tp=2", "parallel.engine = fsdp with parallel.tp = 2: the FSDP engine has no tensor parallelism"),
    ("fsdp.shard_size=3", "fsdp.shard_size = 3 must divide the 2 training ranks"),
    ("fsdp.sp=4", "parallel.tp * parallel.pp * fsdp.sp = 1 * 1 * 4 = 4 does not divide"),
])
def test_impossible_fsdp_layouts_are_refused_naming_the_fields(override, words):
    cfg = load_config(None, ["model.path=/m", "parallel.engine=fsdp", override])
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_model=False)
    assert words in str(e.value)


@pytest.mark.parametrize("engine", ["megatron", "auto"])
def test_fsdp_sp_needs_the_fsdp_engine_and_names_context_parallelism(engine):
    cfg = load_config(None, ["model.path=/m", f"parallel.engine={engine}", "slurm.tasks_per_node=2", "fsdp.sp=2"])
    with pytest.raises(ConfigError, match=r"fsdp.sp = 2 is the FSDP engine's sequence parallelism: set "
                                          r"parallel.engine=fsdp .*split long sequences with parallel.cp"):
        validate(cfg, check_model=False)


def test_fsdp_sp_groups_are_the_data_parallel_ranks():
    """4 ranks at sp 2: two data-parallel groups, so 2 responses per step divide and a micro-batch
    of 2 fits a group's share (at sp 1 each rank would get 1 and a micro-batch of 2 is refused)."""
    common = ["model.path=/m", "data.train_files=[/d.parquet]", "parallel.engine=fsdp", "slurm.tasks_per_node=4",
              "data.train_batch_size=2",
              "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=2"]
    cfg = load_config(None, [*common, "fsdp.sp=2"])
    assert cfg.layout.dp == 2 and "fsdp.sp 2" in cfg.layout.dp_words
    validate(cfg, check_model=False)
    with pytest.raises(ConfigError, match="actor.micro_batch_size = 2 is more than the 1 sequence"):
        validate(load_config(None, common), check_model=False)
    # a token budget is per rank: a group of 2 holds twice it, which must cover one whole sequence
    long = ["data.max_prompt_length=1024", "data.max_response_length=3072"]
    validate(load_config(None, [*common, *long, "fsdp.sp=2", "actor.max_tokens_per_microbatch=2048"]),
             check_model=False)
    with pytest.raises(ConfigError, match=r"actor.max_tokens_per_microbatch = 2048 is smaller than one full"):
        validate(load_config(None, [*common, *long, "fsdp.sp=1", "actor.max_tokens_per_microbatch=2048",
                                    "actor.micro_batch_size=1"]), check_model=False)


def test_fp8_with_fsdp_is_refused():
    cfg = load_config(None, ["model.path=/m", "parallel.engine=fsdp", "slurm.gpus_per_node=2", "model.fp8=true"])
    with pytest.raises(ConfigError, match="model.fp8 = true: FP8 training is the Megatron engine's"):
        validate(cfg, check_model=False)


def test_validate_resolves_auto_against_the_model_folder(folders):
    ok = load_config(None, [f"model.path={folders['unmapped']}", "parallel.engine=auto", "trainer.job=smoke"])
    validate(ok)  # FSDP for the unmapped folder at tp 1: nothing to refuse
    bad = load_config(None, [f"model.path={folders['unmapped']}", "parallel.engine=auto", "parallel.tp=2",
                             "trainer.job=smoke"])
    with pytest.raises(ConfigError, match="model.path: Olmo2ForCausalLM is not mapped into Megatron"):
        validate(bad)


def test_compile_without_a_compiler_is_one_line(monkeypatch):
    import shutil

    from verl_hpc.engines.fsdp import build

    monkeypatch.setattr(build, "has_gpu", lambda: False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="fsdp.compile = true needs a C.. compiler .* none of g.., c.., clang.. "
                                          "is on PATH"):
        check_compile(FsdpConfig(compile=True))
    check_compile(FsdpConfig(compile=False))  # off: nothing needed


def test_the_preflight_checks_an_fsdp_folder_as_transformers_loads_it(folders, tmp_path):
    from verl_hpc.launcher.preflight import model_folder_problems

    # Megatron's mapping refuses the architecture; the FSDP engine's check does not
    megatron = model_folder_problems(folders["unmapped"], "model.path", engine="megatron")
    assert any("is not mapped into Megatron" in p for p in megatron)
    fsdp = model_folder_problems(folders["unmapped"], "model.path", engine="fsdp")
    assert not any("Megatron" in p for p in fsdp)
    assert fsdp == [f"model.path: '{folders['unmapped']}' has no *.safetensors files; expected a Hugging Face model folder"]
    bad = _folder(tmp_path, "bad", "NoSuchForCausalLM")  # model_type "nosuch": transformers has no such class
    problems = model_folder_problems(bad, "critic.model_path", engine="fsdp")
    assert problems[0].startswith(f"critic.model_path: transformers cannot load '{bad}' (NoSuchForCausalLM): ")
