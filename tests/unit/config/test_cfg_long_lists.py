"""Long lists in a config (issue 93, section 3): a 6 MB config of 600,000 `rollout.stop` strings took
89 s in `load_config` (and three minutes of dry run on a loaded machine) after a 3 s parse: OmegaConf's
merge wraps and validates every item. Plain lists now skip it (verl_hpc/config/lists.py), with the
same result as before, and the resolved config is written by libyaml's emitter."""
import time
from pathlib import Path

import pytest
import yaml

from verl_hpc.config import ConfigError, lists, load_config, loader, to_yaml
from verl_hpc.config.loader import read_yaml

REPO = Path(__file__).resolve().parents[3]


def stop_strings(path: Path, n: int) -> Path:
    """The smoke config with n plain (unquoted, as a user writes them) stop strings."""
    path.write_text(f"extends: {REPO}/configs/smoke.yaml\nrollout:\n  stop:\n"
                    + "".join(f"    - s{i}\n" for i in range(n)))
    return path


@pytest.mark.heavy  # 600,000 items: about 4 CPU-s to write, parse and load (over make check's 5 s budget)
def test_600000_stop_strings_load_in_time_linear_in_the_file(tmp_path):
    """The merge and the checks now cost about what the parse does (1.4x it, measured; they were 20x),
    in CPU time, which a loaded machine stretches for both alike."""
    path = stop_strings(tmp_path / "long.yaml", 600_000)
    t0 = time.process_time()
    read_yaml(path)
    parse = time.process_time() - t0
    t0 = time.process_time()
    cfg = load_config(path)
    load = time.process_time() - t0  # the parse again, the merge, the checks
    assert len(cfg.rollout.stop) == 600_000 and cfg.rollout.stop[0] == "s0" and cfg.rollout.stop[-1] == "s599999"
    assert load < 3 * parse + 1, f"load_config {load:.1f} CPU-s for a file whose parse takes {parse:.1f}"
    assert load < 30, f"load_config {load:.1f} CPU-s"


# what OmegaConf does to a list item, and what a list may be referred to by: the lifted lists must
# come out of compose exactly as they came out of the merge
CASES = [
    ["rollout.stop=[a, 'b c', '', 7, true]"],  # converted to str by the check, before either path
    ["rollout.stop=['\\${x}', 'y']"],  # escaped: OmegaConf makes it a literal '${x}'
    ["rollout.stop=[a, b]", "trainer.experiment_name=${rollout.stop[1]}"],  # referred to by its key
    ["rollout.stop=[a, b]", "trainer.experiment_name=${rollout.stop}"],  # the whole list: the same refusal
    ["actor.optim.betas=[0.8, 1]", "safety.profile_steps=[2, 3]"],  # floats and ints
    ["algorithm.recipe=grpo", "rollout.stop=[z]"],  # over a recipe
]


@pytest.mark.parametrize("overrides", CASES)
def test_lifted_lists_come_out_as_the_merge_gave_them(overrides, monkeypatch):
    def outcome():
        try:
            return load_config(None, overrides)
        except ConfigError as err:
            return str(err)

    lifted = outcome()
    monkeypatch.setattr(lists, "lift", lambda data, refs: {})  # every list through OmegaConf, as before
    assert lifted == outcome()


def test_a_list_an_interpolation_may_refer_to_stays_in_the_merge():
    data = {"rollout": {"stop": ["a"], "n": 2}, "data": {"train_files": ["f"]}, "actor": {"optim": {"betas": [1.0]}}}
    refs = lists.referred(["${rollout.stop[0]}", "x/${actor}/y", "${oc.env:HOME}"])
    assert lists.lift(data, refs) == {("data", "train_files"): ["f"]}
    assert data["data"]["train_files"] == [] and data["rollout"]["stop"] == ["a"] and data["actor"]["optim"]["betas"] == [1.0]
    assert not lists.lift({"rollout": {"stop": ["${x}"]}}, lists.referred([]))  # an item OmegaConf resolves


def test_to_yaml_writes_what_the_pure_emitter_wrote_and_reads_back(tmp_path):
    odd = ["", " lead", "tab\there", "new\nline", "\x85", "\u2028", "é", "#c", "a: b", "yes", "null", "1e5",
           "0x10", "${x}", "x" * 200, " ".join(["word"] * 40), "\ufeff", "\U0001F600"]
    cfg = load_config(None, [])
    cfg.rollout.stop = odd
    text = to_yaml(cfg)
    assert text == yaml.safe_dump(loader.escape_interpolations(loader.to_container(cfg)), sort_keys=False,
                                  default_flow_style=False, allow_unicode=False)
    (tmp_path / "resolved.yaml").write_text(text)
    assert load_config(tmp_path / "resolved.yaml") == cfg
