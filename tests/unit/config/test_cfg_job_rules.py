"""Rules a running job applies to config values are the loader's rules too: each bad value below
is refused by `load_config` + `validate` (what `submit --dry-run` runs), in one line naming the
field, before any rank starts."""
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
    (["rollout.seed=-1"], "rollout.seed", ">= 0"),
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
