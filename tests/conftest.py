"""Shared pytest setup: GPU tests skip only where no CUDA device exists; nothing else skips."""
import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests either
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        # the marker, not `"gpu" in item.keywords`: keywords also hold the names of the folders
        # above the test (a checkout in a folder named gpu would skip every test)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


def _wait_for_text(folder, pattern, needle, proc=None, timeout=180) -> float:
    """Poll files matching `pattern` (recursive glob under `folder`) until one contains `needle`;
    returns the time it was seen. Fails (never hangs) if the process ends first or time runs out."""
    import time
    from pathlib import Path

    end = time.time() + timeout
    while time.time() < end and (proc is None or proc.poll() is None):
        for f in Path(folder).glob(pattern):
            if needle in f.read_text(errors="replace"):
                return time.time()
        time.sleep(0.2)
    logs = "".join(f"\n--- {f}\n{f.read_text(errors='replace')[-2000:]}"
                   for f in sorted(Path(folder).rglob("*")) if f.is_file())
    raise AssertionError(f"'{needle}' never appeared in {folder}/{pattern}{logs}")


@pytest.fixture
def wait_for_text():
    return _wait_for_text
