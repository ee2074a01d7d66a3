"""Fixtures of the rollout unit tests (helpers: rol_helpers.py)."""
import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("rol") / "llama", "llama"))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a machine shared with other jobs
    OpenMP threads spin-waiting behind them made these tests up to 10x slower (measured: the HF
    file took 199 s with 2 threads, 23 s with 1, same load). Restored after each module."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf(tiny_model):
    """The transformers reference model of tiny_model (fp32, eval)."""
    from rol_helpers import load_hf

    return load_hf(tiny_model)


@pytest.fixture(scope="module")
def original(tiny_model):
    """tiny_model's checkpoint tensors (to put back after a test changes an engine's weights)."""
    from safetensors.torch import load_file

    return load_file(f"{tiny_model}/model.safetensors")
