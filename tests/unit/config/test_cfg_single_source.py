"""Every default and every range is written once: in the field's declaration (config/sections/).

The scan looks for another module that repeats a field's distinctive default as a keyword default
or an assignment (`bucket_mb: int = 512`, `gpu_memory_utilization=0.5`), words a declared range
check of its own or lists a field's valid values; and for the layout rules outside config/layout.py. (test_cfg_loading checks that
--print-config shows every field.)
"""
import dataclasses
import re
from pathlib import Path

from verl_hpc.config.fields import walk
from verl_hpc.config.schema import JobConfig


REPO = Path(__file__).resolve().parents[3]
# Everything outside config/ is scanned, the algorithm library included: its pure functions take
# config fields as required arguments, bound by a section's from_config (a method's own convention,
# e.g. SimPO's beta or GMPO's log-space clip, is another value and not matched).
SOURCES = {p: p.read_text() for p in (REPO / "verl_hpc").rglob("*.py")
           if p.relative_to(REPO / "verl_hpc").parts[0] != "config"}
WORDS = {p: set(re.findall(r"\w+", text)) for p, text in SOURCES.items()}  # to skip files quickly
TRIVIAL = (0, 1, -1, 0.0, 1.0, True, False, None, "", "auto", "none")


def _distinctive_defaults():
    for key, value, meta, _ in walk(JobConfig()):
        if isinstance(value, (list, dict)) or any(value == t and type(value) is type(t) for t in TRIVIAL):
            continue
        yield key, value


def _pattern(name: str, value) -> re.Pattern:
    literal = re.escape(repr(value)) if not isinstance(value, str) else f"[\"']{re.escape(value)}[\"']"
    if isinstance(value, float):  # 1e-6 and 1e-06 and 0.000001 are the same default
        spellings = {repr(value), f"{value:g}", f"{value:.0e}", re.sub(r"e([+-])0+(?=\d)", r"e\1", f"{value:.0e}")}
        literal = "(?:" + "|".join(re.escape(t) for t in spellings) + ")"
    return re.compile(rf"\b{re.escape(name)}\s*(?::\s*[\w\[\]., |]+)?\s*=\s*{literal}(?![\w.])")


def test_no_module_repeats_a_config_default():
    hits = []
    for key, value in _distinctive_defaults():
        name = key.rsplit(".", 1)[-1]
        pat = _pattern(name, value)
        hits += [f"{p.relative_to(REPO)}: {m.group(0)!r} repeats {key} = {value!r}"
                 for p, text in SOURCES.items() if name in WORDS[p] for m in pat.finditer(text)]
    assert not hits, "defaults written twice (take them from the config section):\n" + "\n".join(hits)


def test_no_module_words_a_declared_range_check():
    declared = [key for key, _, meta, _ in walk(JobConfig()) if meta.get("check")]
    hits = [f"{p.relative_to(REPO)} checks {key} itself" for key in declared
            for p, text in SOURCES.items() if f"{key}: must be" in text]
    assert not hits, "\n".join(hits)


# Modules that keep their own copy of a choice list, and why (a light import: no config, no torch).
OWN_CHOICE_LISTS = {
    "verl_hpc/tracking/tracker.py": "tracking.backends: verl_hpc.tracking imports neither config nor torch",
    "verl_hpc/rewards/gsm8k.py": "reward.gsm8k_method: the GSM8K extractor is a plain-Python module",
    "verl_hpc/checkpoint/dtypes.py": "model.dtype: the HDF5 dtype table names more dtypes than the model's",
    # what the code implements, for callers without a config; a test keeps each equal to the choices
    # (tests/unit/data/test_data_templates_filter.py, tests/unit/rollout/test_rol_core.py,
    # tests/unit/engines/test_eng_gpu_paths.py, tests/unit/rewards/test_rw_scorer.py,
    # tests/unit/planning/test_plan_published.py, tests/unit/rollout/test_tools.py)
    "verl_hpc/data/filtering.py": "data.overlong_prompts: what filter_overlong implements",
    "verl_hpc/rollout/prompts.py": "rollout.prompt_overflow: what fit_prompts implements",
    "verl_hpc/models/gpt.py": "model.fp8_recipe: the recipes build_gpt_model hands to Megatron",
    "verl_hpc/rewards/scorer.py": "reward.on_error: what RewardScorer.score implements",
    "verl_hpc/rollout/tools/builtin.py": "multi_turn.tools: the built-in tools BUILTINS implements",
    "verl_hpc/planning/training.py": "parallel.recompute_granularity: what the activation model implements",
}


def test_no_module_repeats_a_declared_choice_list():
    """A line naming every valid value of a field as a string literal is a second copy of the list:
    name what the code implements and list the module in OWN_CHOICE_LISTS, with a test."""
    hits = []
    for key, _, meta, _ in walk(JobConfig()):
        choices = [c for c in meta.get("choices") or () if c]
        if len(choices) < 2:
            continue
        for p, text in SOURCES.items():
            rel = str(p.relative_to(REPO))
            if not all(c in text for c in choices):  # no line of this file can name them all
                continue
            hits += [f"{rel}: {line.strip()!r} lists {key}'s choices" for line in text.splitlines()
                     if all(re.search(rf"[\"']{re.escape(c)}[\"']", line) for c in choices)
                     and rel not in OWN_CHOICE_LISTS]
    assert not hits, "choice lists written twice:\n" + "\n".join(hits)


def test_only_config_reads_the_declarations():
    """Outside config/, a field's default or choices come in as arguments (bound by from_config), not
    from default_of/choices_of (the tests compare the implemented names with choices_of)."""
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p, text in SOURCES.items()
            for i, line in enumerate(text.splitlines(), 1) if re.search(r"\b(default_of|choices_of)\b", line)]
    assert not hits, "config declarations read outside config/:\n" + "\n".join(hits)


def test_layout_rules_live_in_one_module():
    rules = ("does not divide the world size", "does not divide the model's", "ranks per model replica",
             "inference replica; valid")
    hits = [f"{p.relative_to(REPO)}: {r!r}" for p in (REPO / "verl_hpc").rglob("*.py")
            for r in rules if r in p.read_text() and p.name != "layout.py"]
    assert not hits, "layout rules outside verl_hpc/config/layout.py:\n" + "\n".join(hits)


def test_every_field_is_documented():
    undocumented = [key for key, _, meta, _ in walk(JobConfig()) if not meta.get("help") and not meta.get("auto")
                    and key.rsplit(".", 1)[0] != "slurm"]  # partition, account, qos: Slurm's own words
    assert not undocumented, f"fields without help text: {undocumented}"


def test_sections_are_declared_with_opt():
    """A field declared as a plain `x: int = 3` would have no help, no check and no place in base.yaml."""
    bare = [key for key, _, meta, _ in walk(JobConfig()) if "help" not in meta]
    assert not bare, f"fields not declared with verl_hpc.config.fields.opt: {bare}"
    assert all(dataclasses.is_dataclass(v) for v in vars(JobConfig()).values())
