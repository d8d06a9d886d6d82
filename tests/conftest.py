"""Shared test fixtures: seeded randomness, a tuning cache per test, fresh torch.compile state where asked,
and `gpu` tests skipped where there is no CUDA, else run one at a time across pytest workers; under Triton's CPU
interpreter, its language patched once per launch."""

import fcntl
import gc
import os
import tempfile

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


class OneGpuAtATime:
    """An exclusive file lock that a process holds while it runs `gpu` tests.

    Every `gpu` test uses the one device ("cuda"), and torch's caching allocator keeps what a test freed for its own
    process: pytest workers running them side by side run out of memory, or leave a layer too little room for its
    fp4 MMA fragments (session 40: 56 of 910 GPU tests failed that way under ``-n 4``). pytest-xdist's
    ``--dist loadgroup`` would keep them on one worker, but with pytest 9.2 it stops grouping without a word
    (pytest-xdist issue 1386), so the workers take turns instead, whatever the ``--dist`` mode: a worker takes the
    lock before its first `gpu` test and gives it back, its cache emptied, after a test whose successor is not one
    (its module's fixtures are finalized by then). Another suite on the same machine waits for it as well. A
    worker waiting is idle, and the wait counts in its test's setup time. The lock is a file, ``MOE_GPU_TEST_LOCK``
    or one per user in the temp directory; the system drops it with the process that holds it."""

    def __init__(self, path: str):
        self.path = path
        self._file = None

    def acquire(self):
        if self._file is None:
            self._file = open(self.path, "a")
            fcntl.flock(self._file, fcntl.LOCK_EX)

    def release(self):
        if self._file is not None:
            gc.collect()  # tensors a test left in a reference cycle, so that the cache can give their blocks back
            torch.cuda.empty_cache()
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


_GPU = OneGpuAtATime(os.environ.get("MOE_GPU_TEST_LOCK")
                     or os.path.join(tempfile.gettempdir(), f"moe-gpu-tests-{os.getuid()}.lock"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if "gpu" in item.keywords and torch.cuda.is_available():
        _GPU.acquire()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)  # the fixtures that end here (the module's, before another module) are gone after this
    finally:
        if nextitem is None or "gpu" not in nextitem.keywords:
            _GPU.release()


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
