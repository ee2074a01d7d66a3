"""The memory plan with PRIME's implicit PRM: its weights, gradients and optimizer state in its own
column, its forward and update as phases, a frozen PRM with weights only, its offload switches, the
checkpoint holding it, and `python -m verl_hpc.plan` printing all of it."""
from verl_hpc.config import load_config
from verl_hpc.plan import main as plan_main
from verl_hpc.planning import plan_job
from verl_hpc.planning.model_shape import known_arch, stage_params
from verl_hpc.planning.training import Precision, model_state_bytes

PRIME = ["algorithm.adv_estimator=prime", "algorithm.accuracy_filter.enable=true",
         # the PRM batched like the actor (configs/grpo_8b.yaml) and kept resident, so that its rows compare
         "prm.ppo_mini_batch_size=64", "prm.max_tokens_per_microbatch=16384",
         "actor.param_offload=false", "actor.grad_offload=false", "actor.optimizer_offload=false"]


def _state(plan, trainable=True):
    """The 8B model's bytes on the plan's stage (TP 2, DP 4, distributed optimizer), by hand."""
    params = stage_params(known_arch("llama-3-8b"), 2, 1, plan.stage, "lm")
    return model_state_bytes(params, Precision.of("bfloat16"), trainable=trainable, dp=4, distributed_optimizer=True)


def test_prm_state_is_an_actors_worth_and_has_its_phases():
    cfg = load_config("configs/grpo_8b.yaml", PRIME)
    plan = plan_job(cfg)
    t = plan.table
    assert {"prm_logprob", "update_prm"} <= set(t) and cfg.prm.enable and cfg.ref.enable
    # weights + fp32 grads + Adam (distributed over DP 4) of the same 8B model as the actor
    assert t["update_prm"]["prm"] == sum(_state(plan).values()) > 10e9
    assert t["update_prm"]["prm"] == t["update_actor"]["actor"]
    assert t["update_prm"]["activations"] == t["update_actor"]["activations"] > 0  # the same micro-batches
    assert t["update_actor"]["prm"] == t["update_prm"]["prm"]  # not offloaded: it stays while the actor trains
    no_prm = plan_job(load_config("configs/grpo_8b.yaml", PRIME[2:]))
    assert "prm_logprob" not in no_prm.table and all(r["prm"] == 0 for r in no_prm.table.values())
    assert plan.peak - no_prm.peak >= sum(_state(plan).values())  # its state counts against the peak
    # the checkpoint saves it (a frozen PRM is rebuilt from its folder instead)
    frozen = plan_job(load_config("configs/grpo_8b.yaml", [*PRIME, "prm.update=none"]))
    assert plan.host["checkpoint"] > frozen.host["checkpoint"]


def test_a_frozen_prm_holds_weights_only_and_offload_empties_it_while_idle():
    frozen = plan_job(load_config("configs/grpo_8b.yaml", [*PRIME, "prm.update=none"]))
    assert "update_prm" not in frozen.table
    assert frozen.table["prm_logprob"]["prm"] == _state(frozen, trainable=False)["weights"]
    off = ["prm.param_offload=true", "prm.grad_offload=true", "prm.optimizer_offload=true"]
    plan = plan_job(load_config("configs/grpo_8b.yaml", [*PRIME, *off]))
    t = plan.table
    assert t["update_actor"]["prm"] == 0 and t["rollout"]["prm"] == 0
    assert t["prm_logprob"]["prm"] == _state(plan)["weights"] < t["update_prm"]["prm"] == sum(_state(plan).values())


def test_the_plan_cli_prints_the_prm(capsys):
    plan_main(["configs/grpo_8b.yaml", *PRIME, "--gpu-memory-gb", "80"])
    out = capsys.readouterr().out
    assert "prm_logprob" in out and "update_prm" in out and "prm" in out.split("\n", 3)[-1]
