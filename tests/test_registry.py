"""A broken plugin cannot take `moe` down, and `moe backends` tells implemented from usable here.

Plugins are faked: a module written to a temporary directory, reached through an
``importlib.metadata.EntryPoint`` that ``moe.registry.entry_points`` returns, with a fake distribution.
The ``fresh_registry`` fixture gives each test the built-in backends only and restores the registry after.
"""

from __future__ import annotations

import re
import sys
import textwrap
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe import FusedMoE, MoEConfigError, MoEProblem, Platform
from moe import registry
from moe.tools.cli import backends_table, main
from moe.experts.reference import ReferenceExperts
from moe.experts.torch_grouped import TorchGroupedExperts
from moe.oracle import plan
from moe.prepare_finalize.local import LocalPrepareFinalize
from moe.platform import LIBRARIES, LIBRARY_EXTRAS, missing_library_reason
from moe.registry import BrokenPluginWarning
from moe.testing.inputs import random_dense

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = MoEProblem.create(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
CPU = Platform.preset("cpu")


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as it is with the built-in backends only, not loaded yet; restored afterwards."""
    registry.load_backends()  # the built-in modules are imported once, for good
    builtin = lambda table: {n: c for n, c in table.items() if registry.is_builtin(c)}  # noqa: E731
    monkeypatch.setattr(registry, "_EXPERTS", builtin(registry._EXPERTS))
    monkeypatch.setattr(registry, "_PREPARE_FINALIZE", builtin(registry._PREPARE_FINALIZE))
    monkeypatch.setattr(registry, "_BROKEN", {})
    monkeypatch.setattr(registry, "_ORIGIN", {})
    monkeypatch.setattr(registry, "_loaded", False)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("moe_fake_plugin"):
            del sys.modules[name]


@pytest.fixture
def install(monkeypatch, tmp_path, fresh_registry):
    """``install(entry_point_name, module_source, distribution)``: the only ``moe.backends`` plugin."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def _install(name: str, source: str, dist: str) -> None:
        module = f"moe_fake_plugin_{name}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        ep = EntryPoint(name=name, value=module, group="moe.backends")._for(SimpleNamespace(name=dist))
        monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == "moe.backends" else [])

    return _install


def load_warning() -> str:
    """Loads the backends, expecting exactly one BrokenPluginWarning; returns its text."""
    with pytest.warns(BrokenPluginWarning) as record:
        registry.experts_classes()
    assert len(record) == 1, [str(w.message) for w in record]
    return str(record[0].message)


def assert_builtins_still_work() -> None:
    result = plan(PROBLEM, CPU)
    assert result.buckets[0].chosen.pair.experts == "torch_grouped"
    layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32, quant="fp32")
    layer.load_weights(**random_dense(layer.problem))
    hidden, logits = torch.randn(5, 64), torch.randn(5, 8)
    assert layer(hidden, logits).shape == (5, 64)


# --- an entry point that raises on import --------------------------------------------------------
RAISES_ON_IMPORT = """
    from moe.experts.reference import ReferenceExperts
    from moe.registry import register_experts

    @register_experts
    class Early(ReferenceExperts):  # registered before the module fails: withdrawn with it
        name = "early"

    raise RuntimeError("libfoo 2.0 is missing")
"""


def test_entry_point_raising_on_import_is_skipped_with_one_warning(install):
    install("bad_import", RAISES_ON_IMPORT, "bad-import-dist")
    message = load_warning()
    assert "'bad_import'" in message and "'bad-import-dist'" in message
    assert "RuntimeError: libfoo 2.0 is missing" in message and "report it to its authors" in message
    assert "early" not in registry.experts_classes()  # all or nothing; and no second warning
    assert list(registry.broken_backends()) == ["bad_import"]
    table = backends_table()
    assert re.search(r"^\| bad_import \| broken: import failed, RuntimeError: libfoo 2\.0 is missing .*bad-import-dist",
                     table, re.M)
    assert "| torch_grouped |" in table
    assert_builtins_still_work()


# --- a class whose declarations are missing or of the wrong type ---------------------------------
NO_CAPABILITIES = """
    from moe.experts.base import Experts
    from moe.registry import register_experts

    @register_experts
    class NoCapabilities(Experts):
        name = "no_capabilities"
"""
WRONG_FORMAT = """
    from moe.prepare_finalize.local import LocalPrepareFinalize
    from moe.registry import register_prepare_finalize

    @register_prepare_finalize
    class WrongFormat(LocalPrepareFinalize):
        name = "wrong_format"
        format = "standard"
"""


@pytest.mark.parametrize("source,cls,problem", [
    (NO_CAPABILITIES, "NoCapabilities", "it has no `capabilities`"),
    (WRONG_FORMAT, "WrongFormat", "`format` must be an ActivationFormat (got 'standard')"),
])
def test_class_with_bad_declarations_is_skipped_with_one_warning(install, source, cls, problem):
    install("bad_class", source, "bad-class-dist")
    message = load_warning()
    assert "'bad_class'" in message and "'bad-class-dist'" in message and "MoEConfigError" in message
    assert f"moe_fake_plugin_bad_class.{cls}" in message and problem in message
    assert registry.broken_backends()["bad_class"].startswith("import failed, MoEConfigError")
    assert "| bad_class | broken: import failed, MoEConfigError" in backends_table()
    assert_builtins_still_work()


class _Experts(ReferenceExperts):
    name = "probe"


@pytest.mark.parametrize("attr,value,problem", [
    ("capabilities", None, "`capabilities` must be a moe.Capabilities, not NoneType"),
    ("capabilities", ReferenceExperts.capabilities.__class__(
        formats=frozenset({"standard"}), modes=ReferenceExperts.capabilities.modes,
        output=ReferenceExperts.capabilities.output),
     "capabilities.formats must be a collection of ActivationFormat members (got frozenset({'standard'}))"),
])
def test_register_experts_refuses_malformed_capabilities(fresh_registry, attr, value, problem):
    bad = type("Bad", (_Experts,), {attr: value})
    with pytest.raises(MoEConfigError, match=re.escape(problem)):
        registry.register_experts(bad)
    with pytest.raises(MoEConfigError, match="not a subclass of moe.Experts"):
        registry.register_experts(type("Plain", (), {"name": "plain"}))
    with pytest.raises(MoEConfigError, match=r"`quant_formats` must be a collection of QuantFormat members"):
        registry.register_prepare_finalize(type("Pf", (LocalPrepareFinalize,), {"quant_formats": frozenset({"fp8"})}))
    assert "Bad" not in {c.__name__ for c in registry.experts_classes().values()}


# --- a class whose check raises ------------------------------------------------------------------
CHECK_RAISES = """
    from moe.experts.reference import ReferenceExperts
    from moe.registry import register_experts

    @register_experts
    class RaisingExperts(ReferenceExperts):
        name = "raising_check"

        @classmethod
        def check(cls, problem, platform):
            raise ValueError("bad table")
"""


def test_plugin_check_raising_rejects_that_candidate_only(install):
    install("raising", CHECK_RAISES, "raising-dist")
    assert "raising_check" in registry.experts_classes()  # it imports and registers fine
    with pytest.warns(BrokenPluginWarning) as record:
        first = plan(PROBLEM, CPU)
        plan(PROBLEM, CPU)  # warned once, not per plan
    assert len(record) == 1
    reason = ("check raised ValueError: bad table (plugin 'raising', class moe_fake_plugin_raising.RaisingExperts "
              "from distribution 'raising-dist'; report it to its authors)")
    assert str(record[0].message).endswith(reason)
    assert first.rejected["raising_check"] == (reason,)
    assert reason in first.explain()
    assert registry.broken_backends() == {"raising_check": reason}
    assert re.search(r"^\| raising_check \|.*\| broken: check raised ValueError: bad table", backends_table(), re.M)
    assert_builtins_still_work()


def test_a_raising_check_of_our_own_surfaces(fresh_registry, monkeypatch):
    """The guard is for plugins only: a bug in a built-in check is ours and must not be hidden."""
    def broken(cls, problem, platform):
        raise ValueError("our bug")

    monkeypatch.setattr(TorchGroupedExperts, "check", classmethod(broken))
    with pytest.raises(ValueError, match="our bug"):
        plan(PROBLEM, CPU)


def test_plugin_platform_reasons_raising_do_not_break_the_table(install):
    install("raising_platform", CHECK_RAISES.replace("def check(cls, problem, platform)",
                                                     "def _platform_reasons(cls, platform)"), "raising-dist")
    with pytest.warns(BrokenPluginWarning, match="_platform_reasons raised ValueError: bad table"):
        table = backends_table(CPU)
    assert re.search(r"^\| raising_check \|.*\| broken: _platform_reasons raised .*\| no: _platform_reasons raised",
                     table, re.M)


def test_installed_plugin_without_entry_point_origin_names_its_distribution(fresh_registry, monkeypatch):
    """A class registered outside load_backends (its module imported directly) is traced to its distribution."""
    if not [ep for ep in entry_points(group="moe.backends") if ep.name == "plugin_einsum"]:
        pytest.skip("examples/plugin_backend is not installed (pip install -e examples/plugin_backend)")
    from moe_plugin_example.experts import EinsumExperts

    monkeypatch.setattr(EinsumExperts, "check", classmethod(lambda cls, p, pl: 1 / 0))
    with pytest.warns(BrokenPluginWarning):
        reasons = registry.checked_reasons(EinsumExperts, PROBLEM, CPU)
    assert reasons == ["check raised ZeroDivisionError: division by zero (class "
                       "moe_plugin_example.experts.EinsumExperts from distribution 'moe-plugin-example'; "
                       "report it to its authors)"]


# --- implemented vs usable here ------------------------------------------------------------------
def row(table: str, name: str) -> str:
    found = [line for line in table.splitlines() if line.startswith(f"| {name} |")]
    assert len(found) == 1, name
    return found[0]


def test_here_column_says_no_with_the_install_line_when_a_library_is_missing():
    table = backends_table(Platform.cpu().with_libraries(remove=("triton",)))
    assert row(table, "experts").endswith("| status | here |")
    assert "| implemented | no: needs library 'triton', which is not installed: pip install 'moe[triton]'" in row(
        table, "triton")
    assert row(table, "torch_grouped").endswith("| implemented | yes |")
    h100 = backends_table(Platform.preset("h100").with_libraries(remove=("flashinfer",)))
    assert row(h100, "triton").endswith("| yes |")
    assert row(h100, "flashinfer_cutlass").endswith(
        "| no: needs library 'flashinfer', which is not installed: pip install 'moe[flashinfer]' |")
    assert row(h100, "flashinfer_a2a").endswith(
        "| implemented | no: needs library 'flashinfer', which is not installed: pip install 'moe[flashinfer]' |")
    assert "pip install 'moe[cutedsl]'" in row(backends_table(CPU), "flashinfer_cutedsl")


def test_table_without_a_platform_has_no_here_column():
    """The docs' table: what is implemented, the same on every machine."""
    table = backends_table()
    assert row(table, "experts").endswith("| output | status |")
    assert row(table, "triton").endswith("| implemented |") and "here" not in table


def test_cli_backends_has_the_here_column(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert row(out, "reference").endswith("| implemented | yes |")
    assert row(out, "prepare/finalize").endswith("| status | here |")


def test_plan_explains_a_missing_library_with_its_install_line():
    explained = plan(PROBLEM, Platform.preset("h100").with_libraries(remove=("triton",))).explain()
    assert re.search(r"experts\s+triton\s+rejected:\n\s+- needs library 'triton', which is not installed: "
                     r"pip install 'moe\[triton\]'", explained)


def test_every_library_has_an_extra_that_installs_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(LIBRARY_EXTRAS) == set(LIBRARIES)
    for library, extra in LIBRARY_EXTRAS.items():
        assert any(req.startswith(LIBRARIES[library]) for req in extras[extra]), (library, extra)
    assert missing_library_reason("libfoo") == "needs library 'libfoo', which is not installed"


def test_here_column_says_triton_runs_on_a_cpu_only_in_its_interpreter():
    import dataclasses

    from moe.platform import TRITON_INTERPRETER

    with_triton = Platform.cpu().with_libraries(add=("triton",))
    plain = dataclasses.replace(with_triton, features=with_triton.features - {TRITON_INTERPRETER})
    assert row(backends_table(plain), "triton").endswith(
        "| no: runs on a CPU only in Triton's interpreter (TRITON_INTERPRET=1), which is for tests |")
    interpreter = dataclasses.replace(with_triton, features=with_triton.features | {TRITON_INTERPRETER})
    assert row(backends_table(interpreter), "triton").endswith("| implemented | yes |")
