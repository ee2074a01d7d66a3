import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny HF model folder (2 layers), written once per session for the in-process trainer tests."""
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama", layers=2)
