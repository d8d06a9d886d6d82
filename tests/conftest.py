"""Shared test fixtures: seeded randomness, a tuning cache per test, fresh torch.compile state where asked,
and `gpu` tests skipped where there is no CUDA."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _tuning_cache(tmp_path_factory, monkeypatch):
    """Each test's own tuning cache (``MOE_CACHE_DIR``): none reads or writes the user's ~/.cache/moe."""
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path_factory.mktemp("moe-cache")))


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches and counters emptied before and after a test (its graph counts are its own)."""
    import torch._dynamo  # only the compile tests use it
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
