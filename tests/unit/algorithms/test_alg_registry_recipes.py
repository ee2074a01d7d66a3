"""Registries, by-name dispatch, and the recipe table's agreement with them."""
import pytest
import torch

from verl_hpc import algorithms as alg
from verl_hpc.algorithms.aggregation import LOSS_AGG_MODES
from verl_hpc.algorithms.registry import Registry
from verl_hpc.config import recipes
from alg_options import adv_options


def _same_names(declared, registered):
    assert len(declared) == len(set(declared)), f"duplicate names in {declared}"
    assert set(declared) == set(registered)


def test_name_tuples_equal_registries():
    _same_names(recipes.ADV_ESTIMATORS, alg.ADV_ESTIMATOR_REGISTRY.names())
    _same_names(recipes.POLICY_LOSSES, alg.POLICY_LOSS_REGISTRY.names())
    _same_names(recipes.KL_ESTIMATORS, alg.KL_ESTIMATOR_REGISTRY.names())
    _same_names(recipes.LOSS_AGG_MODES, LOSS_AGG_MODES)
    assert recipes.RECIPE_NAMES == tuple(recipes.RECIPES)
    expected = {"ppo", "grpo", "dr_grpo", "dapo", "rloo", "remax", "reinforce_pp", "gspo", "prime"}
    assert set(recipes.RECIPE_NAMES) == expected


_FIELDS = {
    "algorithm": {
        "adv_estimator": str, "gamma": float, "lam": float, "norm_adv_by_std": bool,
        "use_kl_in_reward": bool, "kl_penalty": str, "kl_ctrl": dict, "filter_groups": bool,
        "overlong_buffer": dict, "accuracy_filter": dict,
    },
    "actor": {
        "policy_loss": str, "clip_ratio_low": float, "clip_ratio_high": float, "clip_ratio_c": float,
        "loss_agg_mode": str, "entropy_coeff": float, "use_kl_loss": bool, "kl_loss_coef": float,
        "kl_loss_type": str,
    },
    "rollout": {"n": int},
    "critic": {"enable": bool},
}


@pytest.mark.parametrize("name", recipes.RECIPE_NAMES)
def test_recipe_uses_exact_config_names_and_valid_values(name):
    recipe = recipes.RECIPES[name]
    assert set(recipe) == set(_FIELDS)
    for section, fields in _FIELDS.items():
        assert set(recipe[section]) == set(fields), (name, section)
        for field, typ in fields.items():
            assert type(recipe[section][field]) is typ, (name, section, field)
    a, actor = recipe["algorithm"], recipe["actor"]
    assert set(a["kl_ctrl"]) == {"type", "kl_coef", "target_kl", "horizon"}
    assert a["kl_ctrl"]["type"] in ("fixed", "adaptive")
    assert set(a["overlong_buffer"]) == {"enable", "len", "penalty_factor"}
    assert set(a["accuracy_filter"]) == {"enable", "low", "high"}
    assert a["adv_estimator"] in recipes.ADV_ESTIMATORS
    assert a["kl_penalty"] in recipes.KL_ESTIMATORS and actor["kl_loss_type"] in recipes.KL_ESTIMATORS
    assert actor["policy_loss"] in recipes.POLICY_LOSSES
    assert actor["loss_agg_mode"] in recipes.LOSS_AGG_MODES
    assert recipe["rollout"]["n"] >= 1
    # a critic exactly when the estimator needs values
    assert recipe["critic"]["enable"] == (a["adv_estimator"] == "gae")
    # group estimators need a group
    if a["adv_estimator"] in ("grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline", "prime"):
        assert recipe["rollout"]["n"] > 1


def test_recipes_carry_their_papers_defining_choices():
    r = recipes.RECIPES
    assert r["dr_grpo"]["algorithm"]["norm_adv_by_std"] is False
    assert r["dr_grpo"]["actor"]["loss_agg_mode"] == "seq-mean-token-sum-norm"
    assert r["dapo"]["actor"]["clip_ratio_high"] == 0.28 and r["dapo"]["actor"]["clip_ratio_low"] == 0.2
    assert r["dapo"]["algorithm"]["filter_groups"] and r["dapo"]["algorithm"]["overlong_buffer"]["enable"]
    assert r["grpo"]["actor"]["use_kl_loss"] and r["grpo"]["actor"]["kl_loss_coef"] == 0.04
    assert r["ppo"]["algorithm"]["use_kl_in_reward"] and r["ppo"]["algorithm"]["lam"] == 0.95
    assert r["gspo"]["actor"]["policy_loss"] == "gspo" and r["gspo"]["actor"]["clip_ratio_high"] == 4e-4
    assert r["prime"]["algorithm"]["adv_estimator"] == "prime" and r["prime"]["algorithm"]["accuracy_filter"]["enable"]
    assert not any(rec["algorithm"]["accuracy_filter"]["enable"] for name, rec in r.items() if name != "prime")


def test_recipes_module_imports_nothing_from_the_project():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(recipes))
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports == []


@pytest.mark.parametrize(
    "getter, valid, field",
    [
        (alg.get_adv_estimator, "grpo", "algorithm.adv_estimator"),
        (alg.get_policy_loss, "vanilla", "actor.policy_loss"),
        (alg.get_kl_estimator, "low_var_kl", "kl_penalty"),
    ],
)
def test_bad_name_lists_valid_names(getter, valid, field):
    assert callable(getter(valid))
    with pytest.raises(ValueError) as err:
        getter("nope")
    msg = str(err.value)
    assert "'nope'" in msg and field in msg and valid in msg


def test_duplicate_registration_rejected():
    reg = Registry("thing", "x.y")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(lambda: 2)


def test_dispatch_passes_only_declared_inputs_and_rejects_unknown_or_missing():
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    m = torch.ones(2, 2)
    # grpo ignores `values`/`gamma`, which the trainer may pass to every estimator
    adv, _ = alg.compute_advantages("grpo", r, m, group_ids=[0, 0], values=torch.zeros(2, 2), **adv_options(gamma=0.9))
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5]) / (0.5**0.5 + 1e-6))
    with pytest.raises(ValueError, match=r"needs input\(s\) \['values'\]"):
        alg.compute_advantages("gae", r, m, **adv_options())
    with pytest.raises(ValueError, match="unknown keyword.*'gama'"):
        alg.compute_advantages("gae", r, m, values=torch.zeros(2, 2), gama=0.9, **adv_options())
    with pytest.raises(ValueError, match="unknown keyword.*'clip_ratio'"):
        alg.compute_policy_loss("vanilla", r, r, r, m, clip_ratio=0.2)
