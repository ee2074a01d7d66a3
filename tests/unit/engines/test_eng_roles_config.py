"""Role -> engine options from the job config (EngineOptions.for_role, fed by the trainer's engine_options)."""
import pytest

from verl_hpc.config.schema import JobConfig
from verl_hpc.trainer.roles import engine_options


def _cfg():
    cfg = JobConfig()
    cfg.model.path, cfg.model.dtype = "/models/policy", "bfloat16"
    cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_microbatch = 3, 4096
    cfg.critic.model_path, cfg.critic.micro_batch_size = "/models/critic", 5
    cfg.rollout.temperature, cfg.trainer.total_steps = 0.7, 42
    cfg.parallel.use_distributed_optimizer = False
    return cfg


def test_actor_and_reference_share_the_policy_model():
    cfg = _cfg()
    actor, ref = engine_options(cfg, "actor"), engine_options(cfg, "ref")
    for o in (actor, ref):
        assert (o.model_path, o.head, o.dtype, o.temperature) == ("/models/policy", "lm", "bfloat16", 0.7)
        assert (o.micro_batch_size, o.max_tokens_per_microbatch) == (3, 4096)
        assert not o.use_distributed_optimizer and o.total_steps == 42
    assert actor.trainable and actor.optim is cfg.actor.optim
    assert not ref.trainable and ref.optim is None


def test_critic_and_reward_model_have_value_heads():
    cfg = _cfg()
    critic = engine_options(cfg, "critic", fp8=True, loss_norm_len=128.0)
    assert (critic.model_path, critic.head, critic.micro_batch_size) == ("/models/critic", "value", 5)
    assert critic.trainable and critic.optim is cfg.critic.optim and critic.optim.lr == 1e-5
    assert critic.fp8 and critic.loss_norm_len == 128.0
    cfg.critic.model_path = ""
    cfg.resolve()  # auto values are filled once, when a config is loaded (here: built in Python)
    assert engine_options(cfg, "critic").model_path == "/models/policy"  # auto: model.path
    with pytest.raises(ValueError, match="reward.reward_model.path"):
        engine_options(cfg, "reward")
    cfg.reward.reward_model.path = "/models/rm"
    rm = engine_options(cfg, "reward")
    assert (rm.model_path, rm.head, rm.trainable) == ("/models/rm", "value", False)


def test_unknown_role():
    with pytest.raises(ValueError, match="valid: actor, critic, ref, reward"):
        engine_options(_cfg(), "judge")


def test_options_declare_no_defaults_and_default_options_is_the_default_config():
    import dataclasses

    from verl_hpc.config import load_config
    from verl_hpc.engines.options import EngineOptions, default_options

    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(EngineOptions))
    cfg = load_config(None)
    o = default_options("/m", micro_batch_size=2)
    want = dataclasses.replace(engine_options(cfg, "actor"), model_path="/m", micro_batch_size=2)
    assert o == want and o.dtype == cfg.model.dtype and o.share_prompts == cfg.actor.share_prompts
