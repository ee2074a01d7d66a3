"""safety: switches off by default and in production recipes; reward.allow_custom_code moved with
a clear error; the banner; profiling traces; the cross-rank consistency check."""
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.trainer.hooks.safety import SafetySwitches, banner, first_difference, log_banner

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("recipe", ["configs/ppo_70b.yaml", "configs/grpo_8b.yaml"])
def test_production_configs_keep_every_switch_off(recipe):
    cfg = load_config(REPO / recipe)
    assert cfg.safety.switched_on == [], f"{recipe} turns on safety.{cfg.safety.switched_on}"
    assert not cfg.model.trust_remote_code and not cfg.reward.custom_function
    assert banner(cfg) == ""


def test_defaults_are_off():
    s = load_config(None).safety
    assert (s.allow_custom_code, s.profiling, s.debug) == (False, False, False)


def test_old_key_says_where_it_moved():
    with pytest.raises(ConfigError, match="'reward.allow_custom_code' .* moved to 'safety.allow_custom_code'"):
        load_config(None, ["reward.allow_custom_code=true"])


def test_custom_code_needs_the_switch():
    def problems(*overrides):
        cfg = load_config(None, list(overrides))
        return " | ".join(cfg.safety.check(cfg))

    assert "reward.custom_function = 'my.mod:score' runs your own code: set safety.allow_custom_code=true" in \
        problems("reward.custom_function=my.mod:score")
    assert "model.trust_remote_code = true runs code shipped with the model folder: set safety.allow_custom_code" \
        in problems("model.trust_remote_code=true")
    assert problems("reward.custom_function=my.mod:score", "model.trust_remote_code=true",
                    "safety.allow_custom_code=true") == ""
    with pytest.raises(ConfigError, match="safety.allow_custom_code=true"):  # and validate() reports it
        validate(load_config(None, ["reward.custom_function=my.mod:score"]))


def test_banner_on_rank_0_only(caplog):
    cfg = load_config(None, ["safety.debug=true", "safety.profiling=true", "safety.profile_steps=[2,3]"])
    with caplog.at_level(logging.WARNING, logger="verl_hpc.trainer.hooks.safety"):
        log_banner(cfg, SimpleNamespace(rank=1))
        assert caplog.text == ""
        log_banner(cfg, SimpleNamespace(rank=0))
    assert "SAFETY SWITCHES ON" in caplog.text
    assert "safety.debug = true" in caplog.text and "safety.profiling = true" in caplog.text
    assert "steps [2, 3]" in caplog.text and "allow_custom_code" not in caplog.text


def test_profiling_writes_a_trace_for_listed_steps_only(tmp_path):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "safety.profiling=true", "safety.profile_steps=[2]"])
    switches = SafetySwitches(cfg, SimpleNamespace(rank=3))
    for step in (1, 2):
        with switches.step(step):
            torch.matmul(torch.ones(64, 64), torch.ones(64, 64))
    assert [p.name for p in switches.traces] == ["step_000002_rank_00003.json"]
    trace = json.loads(switches.traces[0].read_text())
    assert any("matmul" in e.get("name", "") for e in trace["traceEvents"])
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == ["step_000002_rank_00003.json"]


def test_debug_turns_on_anomaly_detection_and_compares_ranks():
    cfg = load_config(None, ["safety.debug=true"])
    try:
        switches = SafetySwitches(cfg, SimpleNamespace(rank=0))
        assert torch.is_anomaly_enabled()
    finally:
        torch.autograd.set_detect_anomaly(False)
    m = {"train/samples": 8.0, "reward/score/mean": 0.5, "actor/pg_loss": 0.1}
    a = switches.fingerprint(4, m)
    assert "actor/pg_loss" not in a["figures"]  # per-rank figures are not compared
    assert first_difference([a, dict(a)]) == ""
    b = switches.fingerprint(4, dict(m, **{"reward/score/mean": 0.25}))
    assert first_difference([a, a, b]) == "reward/score/mean is 0.25 on rank 2 but 0.5 on rank 0"
    assert "step is 5 on rank 1" in first_difference([a, switches.fingerprint(5, m)])
    nan = switches.fingerprint(4, dict(m, **{"reward/score/mean": float("nan")}))
    assert first_difference([nan, nan]) == ""  # NaN on every rank agrees
