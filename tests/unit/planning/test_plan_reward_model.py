"""The memory plan with reward.reward_model: a scorer's frozen weights (its causal LM's shape plus
the scalar head) in the `reward` column and its forward as the reward_score phase, offloaded while
idle with param_offload; a generative judge's engine awake only in reward_score (vLLM:
judge.gpu_memory_utilization of the GPU); nothing of either in the checkpoint."""
import pytest

from verl_hpc.config import load_config
from verl_hpc.planning import plan_job
from verl_hpc.planning.model_shape import known_arch, stage_params, total_params
from verl_hpc.planning.training import Precision, model_state_bytes

RESIDENT = ["actor.param_offload=false", "actor.grad_offload=false", "actor.optimizer_offload=false"]


def _rm(*extra):
    return plan_job(load_config("configs/grpo_8b.yaml", [*RESIDENT, "reward.reward_model.enable=true", *extra]))


def test_a_scorer_holds_its_weights_and_has_its_phase():
    plain = plan_job(load_config("configs/grpo_8b.yaml", RESIDENT))
    assert "reward_score" not in plain.table and all(r["reward"] == 0 for r in plain.table.values())
    plan = _rm("reward.reward_model.path=/path/to/Meta-Llama-3-8B-rm")
    params = stage_params(known_arch("llama-3-8b"), 2, 1, plan.stage, "value")
    weights = model_state_bytes(params, Precision.of("bfloat16"), trainable=False, dp=4,
                                distributed_optimizer=True)["weights"]
    t = plan.table
    assert t["reward_score"]["reward"] == weights > 1e9
    assert t["update_actor"]["reward"] == weights  # resident unless param_offload
    assert plan.host["checkpoint"] == plain.host["checkpoint"]  # frozen: not saved
    off = _rm("reward.reward_model.path=/path/to/Meta-Llama-3-8B-rm", "reward.reward_model.param_offload=true")
    assert off.table["update_actor"]["reward"] == 0 and off.table["reward_score"]["reward"] == weights


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_a_judge_is_awake_only_while_it_scores(engine):
    plan = _rm("reward.reward_model.kind=judge", "reward.reward_model.path=/path/to/Meta-Llama-3-8B-judge",
               f"reward.reward_model.judge.engine={engine}", "reward.reward_model.judge.gpu_memory_utilization=0.3")
    t = plan.table
    want = 0.3 * plan.limit if engine == "vllm" else 2.0 * total_params(known_arch("llama-3-8b"))
    assert t["reward_score"]["reward"] == pytest.approx(want)
    assert t["update_actor"]["reward"] == 0 and t["rollout"]["reward"] == 0
    assert any("generative judge" in n for n in plan.notes)
