"""Composition: defaults, extends, CLI overrides, recipes, interpolation, serialization."""
import dataclasses
import pickle
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_hpc.config import ConfigError, JobConfig, from_container, load_config, to_container, to_yaml
from verl_hpc.config.loader import parse_override
from verl_hpc.config.recipes import RECIPES

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_defaults_are_a_tiny_cpu_run():
    cfg = load_config(None)
    assert isinstance(cfg, JobConfig)
    assert (cfg.world_size, cfg.dp, cfg.slurm.gpus_per_node, cfg.model.dtype) == (2, 2, 0, "float32")
    assert cfg.trainer.output_dir == "outputs/verl_hpc/run"  # interpolated
    assert cfg.checkpoint.dir == "outputs/verl_hpc/run/checkpoints"  # auto
    assert cfg.rollout.max_tokens == cfg.data.max_response_length  # auto
    assert cfg.critic.enable is False and cfg.ref.enable is False  # auto: grpo, no KL
    assert cfg.critic.optim.lr == 1e-5 and cfg.actor.optim.lr == 1e-6


def test_overrides_on_defaults_and_world_size():
    cfg = load_config(None, ["trainer.total_steps=10", "parallel.tp=2", "slurm.nodes=2",
                             "slurm.tasks_per_node=4"])
    assert (cfg.trainer.total_steps, cfg.parallel.tp, cfg.world_size, cfg.dp) == (10, 2, 8, 4)


def test_extends_precedence(write):
    write("a.yaml", """
        trainer: {total_steps: 1, seed: 1, project_name: a}
        data: {train_batch_size: 16}
    """)
    write("b.yaml", """
        extends: a.yaml
        trainer: {total_steps: 2, seed: 2}
    """)
    write("sub/c.yaml", """
        trainer: {total_steps: 3}
        slurm: {env: {X: "c"}}
    """)
    top = write("top.yaml", """
        extends: [b.yaml, sub/c.yaml]   # b < c < this file
        trainer: {experiment_name: top}
        slurm: {env: {Y: "top"}}
    """)
    cfg = load_config(top, ["trainer.seed=9"])
    assert cfg.trainer.total_steps == 3  # c wins over b (later extends)
    assert cfg.trainer.seed == 9  # CLI wins over every file
    assert cfg.trainer.project_name == "a"  # a grandparent's value survives
    assert cfg.data.train_batch_size == 16
    assert cfg.trainer.output_dir == "outputs/a/top"  # interpolation sees the merged values
    assert cfg.slurm.env == {"X": "c", "Y": "top"}  # mappings merge key by key


def test_extends_relative_to_the_file_not_cwd(write, monkeypatch, tmp_path):
    write("cfg/parent.yaml", "trainer: {total_steps: 7}\n")
    child = write("cfg/deep/child.yaml", "extends: ../parent.yaml\n")
    monkeypatch.chdir(tmp_path / "cfg" / "deep")
    assert load_config(child).trainer.total_steps == 7


def test_lists_are_replaced_not_appended(write):
    parent = write("p.yaml", "data: {train_files: [a.parquet, b.parquet]}\n")
    child = write("c.yaml", f"extends: {parent.name}\ndata: {{train_files: [c.parquet]}}\n")
    assert load_config(child).data.train_files == ["c.parquet"]


@pytest.mark.parametrize("override, key, expected", [
    ("trainer.total_steps=12", "trainer.total_steps", 12),
    ("actor.optim.lr=1e-6", "actor.optim.lr", 1e-6),  # YAML 1.1 reads this as a string
    ("actor.optim.lr=3.0e-5", "actor.optim.lr", 3e-5),
    ("rollout.temperature=1", "rollout.temperature", 1.0),  # int -> float
    ("rollout.kv_cache_memory_bytes=4e9", "rollout.kv_cache_memory_bytes", 4_000_000_000),
    ("data.shuffle=false", "data.shuffle", False),
    ("data.shuffle=True", "data.shuffle", True),
    ("data.train_files=[a.parquet, 'b c.parquet']", "data.train_files", ["a.parquet", "b c.parquet"]),
    ("data.train_files=[]", "data.train_files", []),
    ("actor.optim.betas=[0.9,0.95]", "actor.optim.betas", [0.9, 0.95]),
    ("reward.custom_function=pkg.mod:fn", "reward.custom_function", "pkg.mod:fn"),
    ("slurm.env.NCCL_SOCKET_IFNAME=ib0", "slurm.env", {"NCCL_SOCKET_IFNAME": "ib0"}),
    ("slurm.additional.comment=a=b=c", "slurm.additional", {"comment": "a=b=c"}),  # '=' in a value
    ("slurm.env.OMP_PROC_BIND=1", "slurm.env", {"OMP_PROC_BIND": "1"}),  # number -> str field
    ("trainer.experiment_name=2024", "trainer.experiment_name", "2024"),
    ("trainer.resume=no", "trainer.resume", "no"),  # not YAML 1.1's boolean on a command line
    ("slurm.log_dir=%j/logs", "slurm.log_dir", "%j/logs"),  # '%' would start a YAML directive
    ("model.path=", "model.path", ""),
    ("parallel.vpp=null", "parallel.vpp", None),
    ("parallel.vpp=2", "parallel.vpp", 2),
    ("data.mixture={gsm8k: 2, math: 1}", "data.mixture", {"gsm8k": 2.0, "math": 1.0}),
])
def test_cli_values(override, key, expected):
    value = load_config(None, [override])
    for part in key.split("."):
        value = getattr(value, part) if not isinstance(value, dict) else value[part]
    assert value == expected and type(value) is type(expected)


def test_yaml_words_yes_no_on_off_stay_text_in_a_file(write):
    """YAML 1.1 reads a bare off as false: a choice field then saw false, not its word 'off'."""
    cfg = load_config(write("w.yaml", "rollout: {speculative: {method: off}}\nmodel: {moe_routing_replay: off}\n"))
    assert cfg.rollout.speculative.method == "off" and cfg.model.moe_routing_replay == "off"
    assert load_config(write("t.yaml", "algorithm: {norm_adv_by_std: false}\n")).algorithm.norm_adv_by_std is False
    with pytest.raises(ConfigError, match=r"algorithm\.norm_adv_by_std.*bool"):
        load_config(write("y.yaml", "algorithm: {norm_adv_by_std: yes}\n"))


def test_parse_override_nests_the_key():
    assert parse_override("a.b.c= x=1 ") == {"a": {"b": {"c": "x=1"}}}


def test_interpolation_across_sections_and_env(monkeypatch):
    monkeypatch.setenv("VERL_HPC_TEST_STEPS", "17")
    cfg = load_config(None, ["trainer.total_steps=${oc.env:VERL_HPC_TEST_STEPS}",  # str -> int
                             "rollout.max_tokens=${data.max_response_length}",
                             "data.max_response_length=64",
                             "checkpoint.dir=/scratch/${trainer.experiment_name}/ckpt",
                             r"slurm.setup=['echo \${HOME}']"])  # escaped: stays literal
    assert cfg.trainer.total_steps == 17
    assert cfg.rollout.max_tokens == 64
    assert cfg.checkpoint.dir == "/scratch/run/ckpt"
    assert cfg.slurm.setup == ["echo ${HOME}"]
    assert cfg.slurm.log_dir == "outputs/verl_hpc/run/slurm/%j"


def test_recipe_applies_under_files_and_cli(write):
    path = write("r.yaml", """
        algorithm: {recipe: dapo}
        actor: {clip_ratio_high: 0.3}
        data: {max_response_length: 8192}
    """)
    cfg = load_config(path, ["rollout.n=4"])
    dapo = RECIPES["dapo"]
    assert cfg.algorithm.filter_groups is dapo["algorithm"]["filter_groups"] is True  # from recipe
    assert cfg.algorithm.overlong_buffer.len == dapo["algorithm"]["overlong_buffer"]["len"]
    assert cfg.actor.clip_ratio_low == dapo["actor"]["clip_ratio_low"]
    assert cfg.actor.clip_ratio_high == 0.3  # file beats recipe
    assert cfg.rollout.n == 4  # CLI beats recipe
    assert cfg.actor.optim.lr == 1e-6  # untouched defaults stay


def test_recipe_chosen_on_the_cli_and_auto_roles():
    cfg = load_config(None, ["algorithm.recipe=ppo"])
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.critic.enable is True and cfg.ref.enable is True  # gae -> critic; KL in reward -> ref
    assert RECIPES["ppo"]["rollout"]["n"] == cfg.rollout.n


def test_recipe_does_not_leak_between_loads():
    load_config(None, ["algorithm.recipe=dapo", "actor.clip_ratio_high=0.5"])
    assert load_config(None, ["algorithm.recipe=dapo"]).actor.clip_ratio_high == 0.28
    assert RECIPES["dapo"]["actor"]["clip_ratio_high"] == 0.28


def test_container_round_trip_and_pickle():
    cfg = load_config(CONFIGS / "ppo_70b.yaml", ["slurm.env.A=1", r"slurm.setup=['echo \${HOME}']"])
    data = to_container(cfg)
    assert isinstance(data, dict) and isinstance(data["trainer"], dict)
    back = from_container(pickle.loads(pickle.dumps(data)))
    assert back == cfg
    assert back.slurm.setup == ["echo ${HOME}"]  # a resolved value is literal, not re-interpolated


def test_from_container_partial_dict_fills_defaults_and_recipe():
    cfg = from_container({"algorithm": {"recipe": "rloo"}, "trainer": {"experiment_name": "x"}})
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.trainer.output_dir == "outputs/verl_hpc/x"


def test_to_yaml_reloads_to_an_equal_config(write):
    cfg = load_config(CONFIGS / "grpo_8b.yaml", [r"slurm.setup=['export X=\${HOME}/x', 'module load a']"])
    text = to_yaml(cfg)
    assert yaml.safe_load(text)["parallel"]["tp"] == 2
    assert load_config(write("dump.yaml", text)) == cfg


@settings(max_examples=15, deadline=None, derandomize=True)  # CI must not flake; 300 passed once
@given(st.text(min_size=0, max_size=20), st.integers(min_value=1, max_value=10**9))
@pytest.mark.heavy
def test_property_strings_and_ints_survive_yaml_and_container(name, steps):
    cfg = from_container({"trainer": {"experiment_name": name, "total_steps": steps}})
    assert cfg.trainer.experiment_name == name and cfg.trainer.total_steps == steps
    assert from_container(to_container(cfg)) == cfg
    assert dataclasses.asdict(from_container(yaml.safe_load(to_yaml(cfg)))) == dataclasses.asdict(cfg)


def test_base_yaml_is_generated_from_the_schema():
    """configs/base.yaml is the generated reference; rewrite it with --print-base after a change."""
    from verl_hpc.config.reference import base_yaml

    assert (CONFIGS / "base.yaml").read_text() == base_yaml(), \
        "configs/base.yaml is stale: python -m verl_hpc.config --print-base > configs/base.yaml"


def leaves(d, prefix=""):
    """Dotted leaf keys of a plain nested dict (mapping-valued fields count as leaves)."""
    for k, v in d.items():
        if isinstance(v, dict) and v and f"{prefix}{k}" not in ("slurm.env", "slurm.additional", "data.mixture"):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_base_yaml_is_the_schema_defaults_minus_recipe_fields():
    """base.yaml lists every field with its default, except those recipes set (commented out there)."""
    from verl_hpc.config.structure import all_paths

    raw = yaml.safe_load((CONFIGS / "base.yaml").read_text())
    recipe_keys = {k for r in RECIPES.values() for k in leaves(r)}
    assert set(leaves(raw)) == set(all_paths()) - recipe_keys
    assert load_config(CONFIGS / "base.yaml") == load_config(None)


def test_print_config_shows_every_field():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "verl_hpc.config", "configs/smoke.yaml", "--print-config"],
                         cwd=CONFIGS.parent, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    from verl_hpc.config.structure import all_paths

    assert set(leaves(yaml.safe_load(run.stdout))) == set(all_paths())


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config(None, ["parallel.tp=two"])
    with pytest.raises(ConfigError):
        from_container(["not", "a", "mapping"])


def test_empty_section_in_a_file_is_allowed(write):
    path = write("empty.yaml", "model:\n  # path: /m\ntrainer:\n  seed: 5\n")
    assert load_config(path).trainer.seed == 5


def test_from_container_checks_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.total_step' \(from a config container\)"):
        from_container({"trainer": {"total_step": 3}})
