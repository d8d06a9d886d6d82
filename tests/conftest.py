"""Shared test fixtures: seeded randomness, a tuning cache per test, fresh torch.compile state where asked,
and `gpu` tests skipped where there is no CUDA; under Triton's CPU interpreter, its language patched once per launch."""

import os

import pytest
import torch


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_language_once_per_launch()


def _patch_language_once_per_launch():
    """Triton's CPU interpreter patches ``triton.language`` (its builtins, ``range``, the tensor's dunders) for
    each launch and undoes it when the launch ends -- and again on every call of a ``@triton.jit`` helper inside
    the launch, where it sets the same attributes to closures that behave the same (already patched builtins
    are skipped), walking every member of the language modules each time: 35% of an fp8 decode test's CPU time
    (cProfile, session 21). Here a helper call whose modules this launch has already patched skips that work;
    the launch's own patch and its undoing run as before, so the kernels run the same code. Measured on the
    2-core CI machine: the fp8 decode tests' 7 `matches_grouped_gemm` cases 74.9 -> 52.8 s in one process; the
    whole suite's pytest 704 s (session 21) -> 589 s (2 workers; a Python loop timed the machine as slow in
    both). Leaves an interpreter without these internals as it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched: set[int] = set()  # the language modules patched since the running launch began

    def patch_lang(fn):
        langs = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if patched and langs <= patched:
            return interpreter._LangPatchScope()  # nothing set, nothing to undo
        scope = original(fn)
        patched.update(langs)
        undo = scope.restore

        def restore():  # the launch's patch undone (a helper's scope is never restored): the next one patches
            undo()
            patched.clear()

        scope.restore = restore
        return scope

    interpreter._patch_lang = patch_lang


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
