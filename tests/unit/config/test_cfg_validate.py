"""Semantic checks: ranges, the parallel layout, the algorithm, the model folder."""
import dataclasses

import pytest

from verl_hpc.config import ConfigError, load_config, read_model_shape, validate


# A valid rl job on defaults (world size 2); each case below breaks one thing.
OK = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2"]


def problems(overrides=(), check_model=False, base=OK):
    cfg = load_config(None, list(base) + list(overrides))
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_model=check_model)
    return info.value.problems, str(info.value)


def one_problem(overrides=(), **kw) -> str:
    found, text = problems(overrides, **kw)
    assert len(found) == 1 and text == found[0], text
    return text


def has(message: str, *words: str) -> None:
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


def test_the_baseline_is_valid():
    validate(load_config(None, OK), check_model=False)


CASES = {
    "tp*pp must divide the world size": (
        ["parallel.tp=2", "parallel.pp=2", "slurm.nodes=3"],
        ["parallel.tp * parallel.pp = 2 * 2 = 4 does not divide the world size 6",
         "slurm.nodes 3 * slurm.tasks_per_node 2"]),
    "rollout.tp must divide the world size": (
        ["rollout.tp=4"], ["rollout.tp = 4 does not divide the world size 2"]),
    "more ranks than GPUs": (
        ["slurm.gpus_per_node=1"],
        ["slurm.tasks_per_node = 2 is more than slurm.gpus_per_node = 1", "more ranks than GPUs requested"]),
    "nccl without GPUs": (["parallel.backend=nccl"], ["parallel.backend = nccl", "slurm.gpus_per_node = 0"]),
    "fp8 without GPUs": (["model.fp8=true"], ["model.fp8 needs GPUs"]),
    "vpp needs pp > 1": (["parallel.vpp=2"], ["parallel.vpp = 2 needs parallel.pp > 1"]),
    "sequence parallel needs tp > 1": (["parallel.sequence_parallel=true", "slurm.gpus_per_node=2"],
                                       ["parallel.sequence_parallel needs parallel.tp > 1"]),
    "batch * n divisible by dp": (
        ["slurm.tasks_per_node=4", "data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "rollout.n=2"],
        ["data.train_batch_size * rollout.n = 3 * 2 = 6", "not divisible by the data-parallel size 4",
         "(world size 4 / (parallel.tp 1 * parallel.pp 1))"]),
    "mini batch * n divisible by dp": (
        ["slurm.tasks_per_node=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=1", "rollout.n=2",
         "actor.micro_batch_size=1"],
        ["actor.ppo_mini_batch_size * rollout.n = 1 * 2 = 2 sequences", "data-parallel size 4"]),
    "mini batch divides the batch": (
        ["actor.ppo_mini_batch_size=3"],
        ["actor.ppo_mini_batch_size = 3 does not divide data.train_batch_size = 8"]),
    "micro batch divides each rank's share": (
        ["actor.micro_batch_size=3"],
        ["actor.micro_batch_size = 3 does not divide the 8 sequence(s) each rank gets"]),
    "micro batch above each rank's share": (
        ["slurm.tasks_per_node=8", "actor.micro_batch_size=4"],
        ["actor.micro_batch_size = 4 is more than the 2 sequence(s) each rank gets"]),
    "token budget below one sequence": (
        ["actor.max_tokens_per_microbatch=100"],
        ["actor.max_tokens_per_microbatch = 100 is smaller than one full sequence",
         "data.max_prompt_length + data.max_response_length = 384"]),
    "clip ratio out of range": (["actor.clip_ratio_low=1.5"], ["actor.clip_ratio_low: must be in [0, 1), got 1.5"]),
    "dual clip bound": (["actor.clip_ratio_c=0.5"], ["actor.clip_ratio_c", "must be > 1"]),
    "positive ints": (["trainer.total_steps=0"], ["trainer.total_steps: must be > 0, got 0"]),
    "lengths positive": (["data.max_response_length=0"],
                         ["data.max_response_length: must be in [1, 16777216], got 0"]),
    "group estimator needs n >= 2": (
        ["rollout.n=1"], ["rollout.n = 1", "algorithm.adv_estimator = grpo", "rollout.n >= 2"]),
    "custom code needs opt-in": (
        ["reward.custom_function=my.mod:score"],
        ["reward.custom_function = 'my.mod:score'", "safety.allow_custom_code=true"]),
    "critic off with gae": (["algorithm.adv_estimator=gae", "critic.enable=false"],
                            ["critic.enable = false", "algorithm.adv_estimator = gae needs a critic"]),
    "ref off with a KL loss": (["actor.use_kl_loss=true", "ref.enable=false"],
                               ["ref.enable = false", "actor.use_kl_loss needs the reference policy"]),
    "resume path must exist": (["trainer.resume=/no/such/ckpt"],
                               ["trainer.resume: no such checkpoint '/no/such/ckpt'", "auto, never"]),
    "top_p range": (["rollout.top_p=0"], ["rollout.top_p: must be in (0, 1], got 0.0"]),
    "not a number": (["actor.optim.lr=.nan"], ["actor.optim.lr: must be a finite number, got nan"]),
    "overlong buffer longer than the response": (
        ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=512"],
        ["algorithm.overlong_buffer.len = 512", "data.max_response_length = 128"]),
    "rl job needs a model": (["model.path="], ["model.path: empty, but trainer.job = rl"]),
    "smoke fail_rank beyond the world": (["trainer.smoke.fail_rank=2", "trainer.smoke.fail_at_step=1"],
                                         ["trainer.smoke.fail_rank = 2 is not a rank", "world size 2"]),
    "container without an image": (["slurm.container.runtime=apptainer"],
                                   ["slurm.container.image: empty", "apptainer"]),
    "prometheus without a port": (["tracking.backends=[prometheus]"], ["tracking.prometheus_port"]),
}


@pytest.mark.parametrize("overrides, words", CASES.values(), ids=CASES.keys())
def test_semantic_problem(overrides, words):
    has(one_problem(overrides), *words)


def test_all_problems_are_reported_together():
    found, text = problems(["parallel.tp=3", "actor.clip_ratio_low=-0.1", "reward.custom_function=a:b"])
    assert text.splitlines()[0] == "3 problems in the config:"
    assert len(text.splitlines()) == 4
    has(text, "parallel.tp * parallel.pp = 3", "actor.clip_ratio_low", "reward.custom_function")


def test_smoke_job_ignores_rl_fields():
    validate(load_config(None, ["trainer.job=smoke", "rollout.n=1"]), check_model=True)


def test_config_edited_in_python_is_type_checked():
    cfg = load_config(None, OK)
    cfg.parallel.tp = "2"
    with pytest.raises(ConfigError, match=r"parallel.tp: expected int, got '2'"):
        validate(cfg, check_model=False)
    cfg = dataclasses.replace(load_config(None, OK))
    cfg.model.dtype = "fp32"
    with pytest.raises(ConfigError, match=r"model.dtype: invalid value 'fp32'; valid: float32"):
        validate(cfg, check_model=False)


# ---------------------------------------------------------------------------------- model folder
def model_problems(path, overrides=()):
    return problems(["model.path=" + path] + list(overrides), check_model=True, base=OK[1:])


def test_model_checks_pass_on_a_matching_model(model_dir):
    cfg = load_config(None, ["model.path=" + model_dir(), "parallel.tp=2"] + OK[1:])
    validate(cfg, check_model=True)
    assert read_model_shape(cfg.model.path)[:5] == (32, 8, 32, 128256, 0)


def test_missing_model_folder_only_when_checked(tmp_path):
    missing = str(tmp_path / "nope")
    validate(load_config(None, ["model.path=" + missing] + OK[1:]), check_model=False)
    has(model_problems(missing)[1], f"model.path: no such folder '{missing}'")


def test_model_folder_without_config_json(tmp_path):
    has(model_problems(str(tmp_path))[1], "model.path:", "has no config.json")


def test_tp_must_divide_heads_and_kv_heads(model_dir):
    text = one_problem(["model.path=" + model_dir(heads=12, kv=3, layers=12), "parallel.tp=2"],
                       check_model=True)
    has(text, "parallel.tp = 2 does not divide the model's num_key_value_heads = 3")
    found, _ = model_problems(model_dir(heads=9, kv=9, layers=12, name="m9"), ["parallel.tp=2"])
    assert any("num_attention_heads = 9" in f for f in found) and any("num_key_value_heads = 9" in f for f in found)


def test_sequence_must_fit_the_model_window(model_dir):
    text = one_problem(["model.path=" + model_dir(max_position_embeddings=256)], check_model=True)
    has(text, "data.max_prompt_length + data.max_response_length = 384",
        "max_position_embeddings = 256")


def test_pp_must_divide_layers(model_dir):
    text = one_problem(["model.path=" + model_dir(layers=15), "parallel.pp=2"], check_model=True)
    has(text, "parallel.pp = 2 does not divide the model's num_hidden_layers = 15")


def test_vpp_counts_in_the_layer_split(model_dir):
    text = one_problem(["model.path=" + model_dir(layers=32), "parallel.pp=2", "parallel.vpp=3"],
                       check_model=True)
    has(text, "parallel.pp * parallel.vpp = 2 * 3 = 6 does not divide", "num_hidden_layers = 32")


def test_rollout_tp_follows_vllm_kv_head_rule(model_dir, tmp_path):
    # 32 heads, 8 KV heads: rollout.tp=16 replicates KV heads (vLLM allows it), 6 does not fit.
    path = model_dir()
    ok = load_config(None, ["model.path=" + path, "slurm.tasks_per_node=16", "rollout.tp=16",
                            "actor.micro_batch_size=1"] + OK[1:])
    validate(ok, check_model=True)
    text = one_problem(["model.path=" + path, "slurm.tasks_per_node=6", "rollout.tp=6",
                        "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "actor.micro_batch_size=2"],
                       check_model=True)
    has(text, "rollout.tp = 6 does not fit", "num_attention_heads = 32", "num_key_value_heads = 8")


def test_kv_heads_default_to_heads_and_text_config(model_dir, tmp_path):
    import json

    path = model_dir(kv=None, heads=6, name="nokv")
    assert read_model_shape(path).kv_heads == 6
    nested = tmp_path / "vl"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {
        "num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 10}}))
    assert read_model_shape(str(nested))[:5] == (8, 8, 4, 10, 0)


def test_config_json_missing_fields(model_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"num_attention_heads": 4}')
    has(model_problems(str(bad))[1], "model.path:", "has no num_hidden_layers, vocab_size")
    (bad / "config.json").write_text("{not json")
    has(model_problems(str(bad))[1], "model.path: cannot read")
