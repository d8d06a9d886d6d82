"""moe.compose and the PrepareFinalize declaration: composition is a function of the two classes and the
problem, and a transport's reasons come from its `Transport` record."""

from __future__ import annotations

import dataclasses

import pytest

from moe.compose import activation_quant, composition_problems
from moe.experts.reference import ReferenceExperts
from moe.experts.torch_grouped import TorchGroupedExperts
from moe.platform import Platform, missing_library_reason
from moe.prepare_finalize.base import Ranks, Transport
from moe.prepare_finalize.batched import BatchedPrepareFinalize
from moe.prepare_finalize.local import LocalPrepareFinalize
from moe.problem import ParallelConfig
from moe.quant import QuantFormat
from tests.helpers import make_problem


class _CudaOnlyLocal(LocalPrepareFinalize):
    name = "test_cuda_only_local"
    transport = dataclasses.replace(LocalPrepareFinalize.transport, devices=frozenset({"cuda"}),
                                    libraries=("flashinfer",), max_top_k=1)


def test_transport_check_derives_every_reason_from_the_declaration():
    p = make_problem(top_k=2)
    assert _CudaOnlyLocal.check(p, None) == ["supports top_k <= 1 (got 2)"]
    assert _CudaOnlyLocal.check(p, Platform.cpu().with_libraries(remove=("flashinfer",))) == [
        "supports top_k <= 1 (got 2)", "runs on ['cuda'], not cpu", missing_library_reason("flashinfer")]
    ep2 = dataclasses.replace(p, parallel=ParallelConfig(2, 0))
    assert LocalPrepareFinalize.check(ep2, None) == ["serves one rank; ep_size=2 needs an all-to-all prepare/finalize"]
    many = dataclasses.replace(_CudaOnlyLocal.transport, ranks=frozenset({Ranks.EXPERT_PARALLEL}), max_ranks=1,
                               max_top_k=None, expert_map=False)
    reasons = type("ManyRanks", (_CudaOnlyLocal,), {"transport": many}).check(
        dataclasses.replace(p, parallel=ParallelConfig(2, 0, (-1, -1, -1, 0, 1, 2))), None)
    assert reasons == ["places experts contiguously (rank = e // (E / ep_size)); an explicit expert_map is "
                       "not supported: use all_to_all", "supports at most 1 ranks (got ep_size=2)"]


def test_a_subclass_refines_its_parents_transport_by_class_attribute():
    class NoQuantLocal(LocalPrepareFinalize):
        name = "test_no_quant_local"
        quant_formats = frozenset()

    assert NoQuantLocal.transport == dataclasses.replace(LocalPrepareFinalize.transport, quant_formats=frozenset())
    assert NoQuantLocal.quant_formats == frozenset() != LocalPrepareFinalize.transport.quant_formats
    assert LocalPrepareFinalize.format is LocalPrepareFinalize.transport.format
    assert isinstance(LocalPrepareFinalize.transport, Transport)


def test_composition_is_a_function_of_the_classes(monkeypatch):
    """Nothing is constructed: the oracle asks it of classes it never builds."""
    for cls in (BatchedPrepareFinalize, LocalPrepareFinalize, TorchGroupedExperts, ReferenceExperts):
        monkeypatch.setattr(cls, "__init__", lambda self, *a, **k: pytest.fail("constructed"))
    p = make_problem(QuantFormat.FP8_TENSOR, quant="fp8")
    assert composition_problems(LocalPrepareFinalize, ReferenceExperts, p, None) == []
    assert activation_quant(ReferenceExperts, p) is QuantFormat.FP8_TENSOR
    assert composition_problems(BatchedPrepareFinalize, TorchGroupedExperts, p, None) == [
        "batched produces the batched format but torch_grouped takes standard",
        "torch_grouped declares reduced output, which the batched format cannot carry"]
    gpu = Platform.preset("h100")
    assert composition_problems(BatchedPrepareFinalize, TorchGroupedExperts, p, gpu)[2:] == [
        f"torch_grouped on {gpu.name}: {r}" for r in TorchGroupedExperts.check(p, gpu)]
