"""A backend from another package, found through the ``moe.backends`` entry point group.

``examples/plugin_backend`` is that package (``pip install -e examples/plugin_backend``, which the
Makefile's test setup does). The loading mechanism itself is also tested without installing it.
"""

from __future__ import annotations

import importlib
import re
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest
import torch

from moe import FusedMoE, ModularKernel, MoEProblem, Platform, UnsupportedError
from moe import registry
from moe.experts.reference import ReferenceExperts
from moe.oracle import Policy, plan
from moe.prepare_finalize import LocalPrepareFinalize
from moe.router import TopK
from moe.testing import assert_close_moe
from tests.helpers import make_problem, random_inputs, random_weights

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "examples" / "plugin_backend"
MODULE = "moe_plugin_example.experts"


@pytest.fixture
def plugin(monkeypatch):
    """The plugin's module, importable whether or not the package is installed."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    return importlib.import_module(MODULE)


def test_installed_plugin_is_found_through_its_entry_point():
    found = [ep for ep in entry_points(group="moe.backends") if ep.name == "plugin_einsum"]
    if not found:
        pytest.skip("examples/plugin_backend is not installed (pip install -e examples/plugin_backend)")
    assert found[0].value == MODULE
    assert registry.experts_classes()["plugin_einsum"].__module__ == MODULE


def test_load_backends_imports_every_entry_point(monkeypatch):
    """The mechanism, on a fresh registry: an entry point's module is imported and its classes register."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_EXPERTS", {})
    monkeypatch.setattr(registry, "_PREPARE_FINALIZE", {})
    monkeypatch.setattr(registry, "_BROKEN", {})
    monkeypatch.setattr(registry, "_ORIGIN", {})
    monkeypatch.setattr(registry, "_BUILTIN_MODULES", ())
    fake = [EntryPoint(name="plugin_einsum", value=MODULE, group="moe.backends")]
    monkeypatch.setattr(registry, "entry_points", lambda group: fake if group == "moe.backends" else [])
    assert list(registry.experts_classes()) == ["plugin_einsum"]


@pytest.mark.parametrize("quant,bias,expert_map", [("bf16", False, None), ("mxfp4", True, None),
                                                     ("bf16", True, (1, -1, 0, -1, 2, -1))])
def test_plugin_matches_reference(plugin, quant, bias, expert_map):
    from moe.quant import QuantFormat

    fmt = QuantFormat.MXFP4 if quant == "mxfp4" else QuantFormat.NONE
    problem = make_problem(fmt, quant=quant, has_bias=bias, expert_map=expert_map, activation="swiglu_oai")
    weights = random_weights(problem)
    hidden, topk = random_inputs(problem, 7)
    ours = ModularKernel(LocalPrepareFinalize(problem), plugin.EinsumExperts(problem))
    truth = ModularKernel(LocalPrepareFinalize(problem), ReferenceExperts(problem))
    ours.load(weights), truth.load(weights)
    assert_close_moe(ours(hidden, topk), truth(hidden, topk), "bf16")
    empty = TopK(topk.ids[:0], topk.weights[:0])
    assert ours(hidden[:0], empty).shape == (0, problem.hidden_size)


def test_the_oracle_checks_and_explains_the_plugin_but_ranks_it_last_until_measured(plugin):
    problem = MoEProblem.create(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    result = plan(problem, Platform.preset("cpu"), Policy())
    assert "plugin_einsum" in {c.name for c in result.candidates} and "plugin_einsum" not in result.rejected
    assert all(b.chosen.pair.experts == "torch_grouped" for b in result.buckets)
    explained = result.explain()
    assert re.search(r"experts\s+plugin_einsum\s+viable, not chosen", explained)
    forced = plan(problem, Platform.preset("cpu"), Policy(force=("plugin_einsum",)))
    assert "no profile entry" in forced.buckets[0].chosen.experts.basis
    layer = FusedMoE(8, 2, 64, 32, dtype=torch.float32, quant="fp32", experts="plugin_einsum")
    assert repr(layer.kernel) == "ModularKernel(local + plugin_einsum)"
    with pytest.raises(UnsupportedError, match="plugin_einsum"):
        FusedMoE(8, 2, 64, 32, quant="nvfp4", experts="plugin_einsum")

