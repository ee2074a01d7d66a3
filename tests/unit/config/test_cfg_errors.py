"""Every bad structural input gives one line naming the key, the value and what would be valid."""
import pytest

from verl_hpc.config import ConfigError, load_config


def error_of(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message, message  # one line per problem, and structural errors come one at a time
    assert "Traceback" not in message and "full_key" not in message  # no OmegaConf internals
    return message


def has(message: str, *words: str) -> None:
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


# (overrides, words the message must contain)
CLI_CASES = {
    "typo in a key": (["trainer.total_step=5"],
                      ["unknown config key 'trainer.total_step'", "command line 'trainer.total_step=5'",
                       "did you mean 'trainer.total_steps'?"]),
    "typo in a section": (["trainr.total_steps=5"],
                          ["unknown config key 'trainr.total_steps'", "did you mean 'trainer.total_steps'?"]),
    "field of another section": (["trainer.save_every=3"],
                                 ["'trainer.save_every'", "did you mean 'checkpoint.save_every'?"]),
    "nested typo": (["algorithm.kl_ctrl.kl_coeff=0.1"],
                    ["'algorithm.kl_ctrl.kl_coeff'", "did you mean 'algorithm.kl_ctrl.kl_coef'?"]),
    "no close key: list the valid ones": (["parallel.zzz=1"],
                                          ["unknown config key 'parallel.zzz'", "valid in 'parallel':",
                                           "tp, pp, vpp"]),
    "wrong type": (["parallel.tp=two"], ["parallel.tp: expected int, got 'two'"]),
    "float for an int": (["slurm.nodes=1.5"], ["slurm.nodes: expected int, got 1.5"]),
    "word for a bool": (["data.shuffle=maybe"], ["data.shuffle: expected bool (true/false), got 'maybe'"]),
    "null for a non-optional field": (["trainer.seed=null"], ["trainer.seed: expected int, got null"]),
    "scalar for a list": (["data.train_files=a.parquet"],
                          ["data.train_files: expected a list of str, got 'a.parquet'"]),
    "wrong type inside a list": (["actor.optim.betas=[0.9, high]"],
                                 ["actor.optim.betas[1]: expected float, got 'high'"]),
    "scalar for a section": (["trainer=5"], ["trainer: expected a section", "got 5"]),
    "choice": (["model.dtype=bf16"],
               ["model.dtype: invalid value 'bf16'", "valid: float32, bfloat16, float16",
                "did you mean 'bfloat16'?"]),
    "choice from the algorithm names": (["algorithm.adv_estimator=gpro"],
                                        ["algorithm.adv_estimator: invalid value 'gpro'", "gae", "rloo",
                                         "did you mean 'grpo'?"]),
    "kl estimator alias list": (["actor.kl_loss_type=k4"],
                                ["actor.kl_loss_type: invalid value 'k4'", "low_var_kl", "mse"]),
    "choice inside a list": (["tracking.backends=[console, wandbb]"],
                             ["tracking.backends: invalid value 'wandbb'", "did you mean 'wandb'?"]),
    "unknown recipe": (["algorithm.recipe=grop"],
                       ["algorithm.recipe: invalid value 'grop'", "dapo", "did you mean 'grpo'?"]),
    "override without '='": (["trainer.total_steps"],
                             ["malformed override 'trainer.total_steps'", "expected key=value"]),
    "override with a bad key": (["trainer..steps=1"], ["malformed override", "not a dotted config key"]),
    "interpolation of a missing key": (["trainer.output_dir=/x/${trainer.experiment_nam}"],
                                       ["trainer.output_dir: cannot resolve '/x/${trainer.experiment_nam}'",
                                        "no config key 'trainer.experiment_nam'",
                                        "did you mean 'trainer.experiment_name'?"]),
    "interpolation of the wrong type": (["trainer.total_steps=${trainer.project_name}"],
                                        ["trainer.total_steps: '${trainer.project_name}' gives 'verl_hpc'",
                                         "expected int"]),
    "shell variable in a setup line": (["slurm.setup=['echo ${HOME}']"],
                                       ["slurm.setup[0]: cannot resolve 'echo ${HOME}'", "\\${HOME}",
                                        "${oc.env:HOME}"]),
    "malformed interpolation": (["trainer.experiment_name=${oops"],
                                ["trainer.experiment_name: malformed interpolation '${oops'"]),
}


@pytest.mark.parametrize("overrides, words", CLI_CASES.values(), ids=CLI_CASES.keys())
def test_bad_override(overrides, words):
    has(error_of(None, overrides), *words)


def test_unknown_key_in_a_file_names_file_and_line(write):
    path = write("bad.yaml", """
        trainer:
          experiment_name: x
          total_step: 5
    """)
    has(error_of(path), "unknown config key 'trainer.total_step'", f"(from {path}, line 3)",
        "did you mean 'trainer.total_steps'?")


def test_unknown_section_in_a_file(write):
    path = write("bad.yaml", "trainr:\n  total_steps: 5\n  seed: 2\n")
    has(error_of(path), "unknown config key 'trainr'", "line 1", "did you mean 'trainer'?")


def test_wrong_type_in_a_file_names_the_line(write):
    path = write("bad.yaml", "parallel:\n  pp: 1\n  tp: two\n")
    has(error_of(path), "parallel.tp: expected int, got 'two'", f"{path}, line 3")


def test_missing_file():
    has(error_of("/nonexistent/job.yaml"), "config file not found: '/nonexistent/job.yaml'")


def test_missing_extends_names_the_extending_file(write):
    path = write("child.yaml", "extends: bsae.yaml\n")
    has(error_of(path), "config file not found", "bsae.yaml", f"extended by '{path}'")


def test_yaml_syntax_error_names_file_and_line(write):
    path = write("broken.yaml", "trainer:\n  total_steps: 5\n  seed: [1, 2\nslurm: {}\n")
    has(error_of(path), "YAML syntax error in", str(path), "line ")


def test_extends_cycle(write):
    write("a.yaml", "extends: b.yaml\n")
    path = write("b.yaml", "extends: a.yaml\n")
    has(error_of(path), "extends cycle:", "b.yaml -> ", "a.yaml -> ", "b.yaml")


def test_self_extends_is_a_cycle(write):
    path = write("self.yaml", "extends: self.yaml\n")
    has(error_of(path), "extends cycle")


def test_duplicate_key(write):
    path = write("dup.yaml", "trainer:\n  seed: 1\n  seed: 2\n")
    has(error_of(path), "duplicate key 'trainer.seed'", "line 3")


def test_file_that_is_not_a_mapping(write):
    has(error_of(write("list.yaml", "- a\n- b\n")), "must be a mapping of sections")


def test_extends_of_the_wrong_type(write):
    has(error_of(write("e.yaml", "extends: {a: 1}\n")), "extends must be a file name or a list")


def test_recipe_with_a_bad_key_names_the_recipe(monkeypatch):
    from verl_hpc.config import recipes

    monkeypatch.setitem(recipes.RECIPES, "broken", {"actor": {"clip_ratio": 0.1}})
    has(error_of(None, ["algorithm.recipe=broken"]), "unknown config key 'actor.clip_ratio'",
        "recipe 'broken'", "did you mean")
