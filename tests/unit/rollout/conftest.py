"""Fixtures of the rollout unit tests (helpers: rol_helpers.py)."""
import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("rol") / "llama", "llama"))

