"""The verified vLLM range (rollout/vllm/versions.py): which release's handlers a vLLM version gets,
the one warning for an unverified version, and the torch each release goes with."""
import logging

import pytest

from verl_hpc.rollout.vllm import versions


@pytest.mark.parametrize("version, parsed", [("0.25.0", (0, 25, 0)), ("0.32.0+cpu", (0, 32, 0)),
                                             ("0.26.0rc1.dev3+g1234", (0, 26, 0)), ("1.0", (1, 0, 0))])
def test_versions_parse_to_their_release(version, parsed):
    assert versions.parse(version) == parsed


def test_a_version_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValueError, match="vLLM version 'dev' is not of the form MAJOR.MINOR"):
        versions.parse("dev")


@pytest.mark.parametrize("version, handlers", [
    ("0.25.0", "0.25.0"), ("0.32.0", "0.32.0"),  # verified
    ("0.25.1", "0.25.0"), ("0.24.0", "0.25.0"), ("0.20.2", "0.25.0"), ("0.28.0", "0.25.0"),
    ("0.29.0", "0.32.0"), ("0.33.0", "0.32.0"), ("1.0.0", "0.32.0")])
def test_an_unverified_version_gets_the_nearest_verified_release(version, handlers):
    assert versions.nearest(version).version == handlers


def test_two_equally_near_releases_give_the_newer(monkeypatch):
    older, newer = versions.RELEASES
    monkeypatch.setattr(versions, "RELEASES", (older, versions.dataclasses.replace(newer, version="0.27.0")))
    assert versions.nearest("0.26.0").version == "0.27.0"


def test_an_unverified_version_warns_once_naming_the_nearest(monkeypatch, caplog):
    monkeypatch.setattr(versions, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=versions.__name__):
        for _ in range(3):
            assert versions.release("0.33.1").version == "0.32.0"
        assert versions.release("0.32.0").version == "0.32.0"  # verified: no warning
        assert versions.release("0.25.0+cpu").version == "0.25.0"
    said = [r.getMessage() for r in caplog.records]
    assert said == ["vLLM 0.33.1 is not a verified release (verified: 0.25.0, 0.32.0): the compat layer uses "
                    "the handlers of 0.32.0, the nearest; its pins (tests/unit/rollout/test_rol_vllm_compat.py) "
                    "say which targets moved"]


@pytest.mark.parametrize("torch_version, vllm", [("2.11.0+cu130", "0.25.0"), ("2.11.0", "0.25.0"),
                                                 ("2.13.0+cpu", "0.32.0"), ("2.12.0+cu128", None),
                                                 ("2.14.1", None)])
def test_the_vllm_release_that_goes_with_a_torch(torch_version, vllm):
    release = versions.for_torch(torch_version)
    assert (release.version if release else None) == vllm
