"""How the loader parses a config file (issue 83, item 5): once per file, with libyaml's parser
(yaml.CSafeLoader), and with the pure-Python parser's error messages, line numbers included. A
6 MB config took minutes to check: each file was parsed twice (once for its keys' lines and
duplicate keys, once for its values), both times by the pure-Python parser."""
import pytest
import yaml

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config import loader


@pytest.fixture
def parses(monkeypatch):
    """(parser, text) of every parser PyYAML builds from now on: each loader class's __init__
    starts one parse of the text it is given."""
    seen = []
    for cls, kind in ((yaml.SafeLoader, "pure"), (yaml.CSafeLoader, "libyaml")):
        real = cls.__init__

        def counted(self, stream, real=real, kind=kind):
            seen.append((kind, stream))
            real(self, stream)

        monkeypatch.setattr(cls, "__init__", counted)
    return seen


def test_each_file_is_parsed_once_by_libyaml(tmp_path, parses):
    parent = tmp_path / "parent.yaml"
    parent.write_text("trainer:\n  total_steps: 7\n  seed: 3\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: parent.yaml\ntrainer:\n  seed: 5\nrollout:\n  n: 2\n")
    cfg = load_config(child, ["trainer.experiment_name=x"])
    assert (cfg.trainer.total_steps, cfg.trainer.seed, cfg.rollout.n) == (7, 5, 2)
    of_files = sorted(p for p in parses if p[1] in (parent.read_text(), child.read_text()))
    assert of_files == sorted([("libyaml", parent.read_text()), ("libyaml", child.read_text())]), parses


@pytest.mark.parametrize("text, message", [
    # libyaml words each of these otherwise ("did not find expected ',' or ']'", "mapping values
    # are not allowed in this context", "found undefined alias", ...): these are PyYAML's, as before
    ("trainer:\n  total_steps: 5\n  seed: [1, 2\nslurm: {}\n",
     "line 4: expected ',' or ']', but got ':'"),
    ("trainer:\n  seed: 1\n rollout: 2\n", "line 3: expected <block end>, but found '<block mapping start>'"),
    ("a: b: c\n", "line 1: mapping values are not allowed here"),
    ("trainer:\n\tseed: 1\n", "line 2: found character '\\t' that cannot start any token"),
    ("trainer: *nothing\n", "line 1: found undefined alias 'nothing'"),
])
def test_a_syntax_error_has_the_pure_parsers_words_and_line(tmp_path, text, message):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"YAML syntax error in '{path}', {message}", e.value


def test_duplicate_keys_and_lines_are_those_of_before(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("trainer:\n  seed: 1\n  total_steps: 0x10\n  seed: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"duplicate key 'trainer.seed' in '{path}', line 4", e.value
    path.write_text("trainer:\n  seed: 1\n  total_steps: 0x10\n")
    with pytest.raises(ConfigError) as e:  # the value's line, and 0x10 kept as text by the constructor
        load_config(path)
    assert str(e.value) == f"trainer.total_steps: expected int, got '0x10' (from {path}, line 3)", e.value


def test_without_libyaml_the_pure_parser_reads_the_file_the_same(tmp_path, monkeypatch, parses):
    path = tmp_path / "job.yaml"
    path.write_text("trainer:\n  seed: 4\n  experiment_name: off\nrollout:\n  n: 3\n")
    fast = loader.read_yaml(path)
    monkeypatch.setattr(loader, "_FastLoader", loader._ConfigLoader)  # as where PyYAML lacks libyaml
    assert loader.read_yaml(path) == fast == ({"trainer": {"seed": 4, "experiment_name": "off"}, "rollout": {"n": 3}},
                                              {("trainer",): 1, ("trainer", "seed"): 2,
                                               ("trainer", "experiment_name"): 3, ("rollout",): 4, ("rollout", "n"): 5})
    assert [kind for kind, text in parses if text == path.read_text()] == ["libyaml", "pure"]
    path.write_text("a: b: c\n")
    with pytest.raises(ConfigError, match="line 1: mapping values are not allowed here"):
        loader.read_yaml(path)
