"""The tuning cache (`moe.cache`): hits, misses, entries that cannot be trusted, the MOE_CACHE_DIR
setting, atomic writes; FlashInfer's tactics through it (`tactics.tuned_warmup`, with a fake tuner, and
the installed FlashInfer's save/load contract); Triton tables in it; ``python -m moe cache``; the bar."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from moe import MoEProblem
from moe.cache import TuningCache, cache_dir, entry_key, library_versions, open_cache
from moe.errors import CacheWarning
from moe.experts._flashinfer import tactics
from moe.progress import Progress, progress

needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")
PROBLEM = MoEProblem.create(num_experts=8, top_k=2, hidden_size=128, intermediate_size=128, quant="bf16",
                            dtype=torch.bfloat16, max_tokens=64)


def key_of(problem=PROBLEM, buckets=(1, 8, 64), **changes):
    return {**entry_key("test.kind", problem, buckets, "cpu", libraries=("flashinfer",)), **changes}


@contextlib.contextmanager
def cache_warnings(count: int):
    """Exactly ``count`` CacheWarnings inside; yields their messages."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
    messages.extend(str(w.message) for w in caught if issubclass(w.category, CacheWarning))
    assert len(messages) == count, messages


@pytest.fixture
def cache(tmp_path):
    return TuningCache(tmp_path)


# --- the store -----------------------------------------------------------------------------------


def test_miss_then_hit_and_the_entry_carries_its_key_and_checksum(cache):
    key = key_of()
    with cache_warnings(0):
        assert cache.load(key) is None
        path = cache.store(key, {"tactics": [1, 2]})
        assert cache.load(key) == {"tactics": [1, 2]}
    entry = json.loads(path.read_text())
    assert entry["key"] == key and len(entry["checksum"]) == 64
    assert entry["key"]["problem"]["E"] == 8 and entry["key"]["buckets"] == [1, 8, 64]
    assert set(entry["key"]["versions"]) == {"torch", "moe", "flashinfer"}


def test_keys_differ_by_problem_buckets_and_device_but_one_file_holds_every_version(cache):
    other = MoEProblem.create(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, quant="bf16",
                              dtype=torch.bfloat16, max_tokens=64)
    paths = {cache.path_of(key_of()), cache.path_of(key_of(other)), cache.path_of(key_of(buckets=(1, 64))),
             cache.path_of(key_of(device="NVIDIA H200"))}
    assert len(paths) == 4
    assert cache.path_of(key_of(versions={"torch": "0.0"})) == cache.path_of(key_of())


@pytest.mark.parametrize("damage, why", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),  # a write cut short
    (lambda text: text.replace('"tactics": [\n   1', '"tactics": [\n   7'), "checksum"),  # bits changed
    (lambda text: json.dumps({"payload": 1}), "fields missing"),
    (lambda text: "\xff\xfe", "not valid JSON"),
])
def test_a_corrupt_entry_is_ignored_with_one_warning_naming_the_file(cache, damage, why):
    key = key_of()
    path = cache.store(key, {"tactics": [1, 2]})
    path.write_text(damage(path.read_text()))
    with cache_warnings(1) as messages:
        assert cache.load(key) is None
    assert str(path) in messages[0] and why in messages[0]


def test_a_stale_entry_from_other_versions_is_ignored_then_replaced(cache):
    old, new = key_of(versions={"torch": "2.0.0", "moe": "0.0.1"}), key_of()
    cache.store(old, {"tactics": "old"})
    with cache_warnings(1) as messages:
        assert cache.load(new) is None
    assert "stale" in messages[0] and "2.0.0" in messages[0]
    cache.store(new, {"tactics": "new"})
    with cache_warnings(0):
        assert cache.load(new) == {"tactics": "new"}


def test_an_entry_written_for_another_key_is_not_trusted(cache):
    key = key_of()
    path = cache.store(key, {"tactics": 1})
    entry = json.loads(path.read_text())
    entry["key"]["problem"]["H"] = 4096  # as if copied over from another layer
    path.write_text(json.dumps(entry))
    with cache_warnings(1) as messages:
        assert cache.load(key) is None
    assert "wrong key" in messages[0] and "problem" in messages[0]


def test_an_unreadable_entry_is_ignored(cache):
    key = key_of()
    cache.path_of(key).mkdir(parents=True)  # reading it raises IsADirectoryError (root reads any file)
    with cache_warnings(1) as messages:
        assert cache.load(key) is None
    assert "unreadable" in messages[0]


def test_a_failed_write_warns_keeps_the_old_entry_and_leaves_no_temporary_file(cache, monkeypatch):
    key = key_of()
    cache.store(key, {"tactics": "old"})

    def torn(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", torn)
    with cache_warnings(1) as messages:
        assert cache.store(key, {"tactics": "new"}) is None
    assert "cannot write" in messages[0]
    monkeypatch.undo()
    assert cache.load(key) == {"tactics": "old"}
    assert [p.name for p in cache.root.iterdir()] == [cache.path_of(key).name]


WRITER = """
import sys
from pathlib import Path
from moe.cache import TuningCache
cache, key = TuningCache(Path(sys.argv[1])), {"kind": "race", "versions": {}}
for i in range(150):
    cache.store(key, {"writer": sys.argv[2], "blob": [sys.argv[2]] * 2000, "i": i})
"""


def test_two_processes_writing_one_entry_never_leave_a_torn_file(cache):
    key = {"kind": "race", "versions": {}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(cache.root), name], env=env) for name in "ab"]
    seen = set()
    with cache_warnings(0):
        while any(w.poll() is None for w in writers):
            payload = cache.load(key)
            if payload is not None:
                assert payload["blob"] == [payload["writer"]] * 2000
                seen.add(payload["writer"])
    assert [w.returncode for w in writers] == [0, 0]
    assert cache.load(key)["i"] == 149 and seen
    assert not list(cache.root.glob(".tmp-*"))


# --- MOE_CACHE_DIR -------------------------------------------------------------------------------


def test_the_default_folder_is_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("MOE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "moe" and cache_dir().is_dir()


@pytest.mark.parametrize("value", ["", "off", "OFF"])
def test_turned_off_quietly(monkeypatch, value):
    monkeypatch.setenv("MOE_CACHE_DIR", value)
    with cache_warnings(0):
        assert cache_dir() is None and open_cache() is None


@pytest.mark.parametrize("setup, why", [
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "is a file, not a folder"),
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file" / "sub", "cannot be created"),
    (lambda tmp: tmp, "is not writable"),
])
def test_an_unusable_folder_warns_once_and_runs_uncached(monkeypatch, tmp_path, setup, why):
    path = setup(tmp_path)
    monkeypatch.setenv("MOE_CACHE_DIR", str(path))
    if why == "is not writable":  # chmod does not stop root, which runs these tests in CI
        monkeypatch.setattr(os, "access", lambda *args: False)
    with cache_warnings(1) as messages:
        assert open_cache() is None
    assert str(path) in messages[0] and why in messages[0] and "MOE_CACHE_DIR" in messages[0]


def test_versions_name_the_libraries_asked_for_only():
    assert set(library_versions()) == {"torch", "moe"}
    assert library_versions(("no_such_library",))["no_such_library"] == "absent"


# --- FlashInfer's tactics, with a fake tuner ------------------------------------------------------


class FakeTuner:
    """FlashInfer's AutoTuner as `tactics` uses it: a table of tactics per bucket, loaded and saved as
    JSON; ``accepts`` False plays a file from another environment."""

    def __init__(self, accepts: bool = True):
        self.table, self.accepts, self.loads, self.profiled = {}, accepts, 0, []

    def load_configs(self, path: str) -> bool:
        self.loads += 1
        data = json.loads(Path(path).read_text())
        if not self.accepts:
            return False
        self.table.update(data["configs"])
        return True

    def save_configs(self, path: str) -> None:
        Path(path).write_text(json.dumps({"_metadata": {"gpu": "fake"}, "configs": self.table}))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A fresh FakeTuner per "process" (``new()``), and an autotuning context that profiles each bucket
    it is given that the tuner does not hold yet."""
    state = types.SimpleNamespace(tuner=None, buckets=None)

    def new(**kw):
        state.tuner = FakeTuner(**kw)
        return state.tuner

    @contextlib.contextmanager
    def autotuning(buckets=None):
        state.buckets = buckets or (64,)
        yield

    def run():
        for b in state.buckets:
            if str(b) not in state.tuner.table:
                state.tuner.profiled.append(b)
                state.tuner.table[str(b)] = f"tactic-{b}"

    monkeypatch.setattr(tactics, "autotuner", lambda: state.tuner)
    monkeypatch.setattr(tactics, "autotuning", autotuning)
    state.new, state.run = new, run
    return state


def experts_stub(problem=PROBLEM):
    return types.SimpleNamespace(name="flashinfer_cutlass", problem=problem)


def test_a_miss_profiles_under_a_bar_and_stores_then_a_new_process_profiles_nothing(fake_flashinfer, capsys):
    first = fake_flashinfer.new()
    tactics.tuned_warmup(experts_stub(), (1, 8, 64), torch.device("cpu"), fake_flashinfer.run)
    assert first.profiled == [1, 8, 64] and first.loads == 0
    assert "tuning flashinfer_cutlass" in capsys.readouterr().err
    [entry] = open_cache().entries()
    assert json.loads(entry.read_text())["payload"]["configs"] == {"1": "tactic-1", "8": "tactic-8", "64": "tactic-64"}

    second = fake_flashinfer.new()
    with cache_warnings(0):
        tactics.tuned_warmup(experts_stub(), (1, 8, 64), torch.device("cpu"), fake_flashinfer.run)
    assert second.loads == 1 and second.profiled == [] and second.table == first.table
    assert capsys.readouterr().err == ""  # a hit prints nothing


def test_other_buckets_are_another_entry(fake_flashinfer):
    fake_flashinfer.new()
    tactics.tuned_warmup(experts_stub(), (1, 8), torch.device("cpu"), fake_flashinfer.run)
    tuner = fake_flashinfer.new()
    tactics.tuned_warmup(experts_stub(), (1, 8, 64), torch.device("cpu"), fake_flashinfer.run)
    assert tuner.loads == 0 and tuner.profiled == [1, 8, 64]
    assert len(open_cache().entries()) == 2


@pytest.mark.parametrize("spoil, why", [
    (lambda path: path.write_text(path.read_text()[:40]), "corrupt"),
    ("refused", "stale: FlashInfer"),
    (lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "format": 0})), "stale: format"),
])
def test_a_spoiled_entry_warns_once_profiles_again_and_is_rewritten(fake_flashinfer, spoil, why):
    fake_flashinfer.new()
    tactics.tuned_warmup(experts_stub(), (1, 8), torch.device("cpu"), fake_flashinfer.run)
    [entry] = open_cache().entries()
    if spoil != "refused":
        spoil(entry)
    tuner = fake_flashinfer.new(accepts=spoil != "refused")
    with cache_warnings(1) as messages:
        tactics.tuned_warmup(experts_stub(), (1, 8), torch.device("cpu"), fake_flashinfer.run)
    assert str(entry) in messages[0] and why in messages[0]
    assert tuner.profiled == [1, 8]
    assert open_cache().load(json.loads(entry.read_text())["key"])["configs"] == {"1": "tactic-1", "8": "tactic-8"}


def test_with_the_cache_off_it_still_tunes_and_stores_nothing(fake_flashinfer, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_CACHE_DIR", "off")
    tuner = fake_flashinfer.new()
    tactics.tuned_warmup(experts_stub(), (1, 8), torch.device("cpu"), fake_flashinfer.run)
    assert tuner.profiled == [1, 8] and tuner.loads == 0


def test_the_cutlass_warmup_goes_through_the_cache(fake_flashinfer, monkeypatch):
    """The real FlashInferCutlassExperts.warmup on CPU, its kernel call faked: buckets above the tuned
    bound are dropped, the first load tunes, the second loads."""
    from moe.experts.flashinfer_cutlass import FlashInferCutlassExperts

    experts = FlashInferCutlassExperts(PROBLEM)
    monkeypatch.setattr(experts, "apply", lambda dispatched, weights, workspace: fake_flashinfer.run())
    weights = types.SimpleNamespace(w13=torch.empty(0))
    first = fake_flashinfer.new()
    experts.warmup(weights, (1, 8, 64, 512))
    second = fake_flashinfer.new()
    experts.warmup(weights, (1, 8, 64, 512))
    assert first.profiled == [1, 8, 64] and second.profiled == [] and second.loads == 1


# --- FlashInfer's tactics, the installed library -------------------------------------------------


@needs_flashinfer
def test_flashinfer_autotuner_save_and_load_contract():
    from flashinfer.autotuner import AutoTuner

    assert list(inspect.signature(AutoTuner.load_configs).parameters) == ["self", "path"]
    assert list(inspect.signature(AutoTuner.save_configs).parameters) == ["self", "path"]
    assert "cache" in inspect.signature(__import__("flashinfer").autotune).parameters
    saved = tactics.saved_tactics()  # the real tuner, on CPU: metadata and whatever it holds
    assert "_metadata" in saved and saved["_metadata"]["flashinfer_version"] == library_versions(("flashinfer",))["flashinfer"]
    with cache_warnings(0):
        cache = open_cache()
        cache.store(key_of(), saved)
        assert tactics._loaded(cache, key_of())


@needs_flashinfer
def test_flashinfer_refuses_tactics_from_another_gpu_and_that_counts_as_stale():
    saved = tactics.saved_tactics()
    saved["_metadata"] = {**saved["_metadata"], "gpu": "NVIDIA B200", "flashinfer_version": "0.0.1"}
    cache = open_cache()
    cache.store(key_of(), saved)
    with cache_warnings(1) as messages:
        assert not tactics._loaded(cache, key_of())
    assert "stale: FlashInfer" in messages[0]


# --- Triton tables ---------------------------------------------------------------------------------


def test_triton_tables_in_the_cache_come_before_the_packaged_ones_and_a_bad_one_falls_back():
    from moe.experts._triton import config as cfg

    packaged = sorted(cfg.CONFIG_DIR.glob("*.json"))[0]
    data = json.loads(packaged.read_text())
    key = cfg.ConfigKey(**data["key"])
    mine = cfg.LaunchConfig(16, cfg.TileConfig(32, 32), cfg.TileConfig(32, 32))
    path = cfg.ConfigTable(key, ((1, mine),)).save(cfg.triton_cache_dir())
    assert cfg.ConfigTable.load(key).configs == ((1, mine),)
    path.write_text("{")
    with cache_warnings(1) as messages:
        table = cfg.ConfigTable.load(key)
    assert table == cfg.ConfigTable.load(key, cfg.CONFIG_DIR) and table.tuned and str(path) in messages[0]


def test_moe_tune_writes_into_the_cache_by_default(monkeypatch):
    from moe.experts._triton import config as cfg
    from moe.tools.cli import build_parser

    args = build_parser().parse_args(["tune", "--preset", "qwen3-30b-a3b"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Exception, match="CUDA"):  # it stops at the missing GPU, having chosen --out
        args.func(args)
    assert args.out == str(cfg.triton_cache_dir())


# --- python -m moe cache, and the bar --------------------------------------------------------------


def test_cache_command_lists_entries_and_clears_them(capsys):
    from moe.tools.cli import main

    cache = open_cache()
    cache.store(key_of(), {"tactics": 1})
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(cache.root) in out and "1 entries" in out and cache.path_of(key_of()).name in out
    assert main(["cache", "--clear"]) == 0
    assert "cleared 1 entries" in capsys.readouterr().out and cache.entries() == []


def test_the_built_in_bar_redraws_one_line_and_tqdm_is_used_when_importable(monkeypatch):
    stream = io.StringIO()
    bar = Progress(2, "tuning", stream)
    bar.step("M=1")
    bar.step("M=8")
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.count("\n") == 1 and text.endswith("\n") and "2/2" in text
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
    assert isinstance(progress(2, "tuning", io.StringIO()), Progress)
    if importlib.util.find_spec("tqdm"):
        monkeypatch.delitem(sys.modules, "tqdm")
        assert not isinstance(progress(2, "tuning", io.StringIO()), Progress)
