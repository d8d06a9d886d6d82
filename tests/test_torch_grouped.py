"""torch_grouped on CPU: the expert map is built once, at load; under expert maps with -1 entries it
matches reference on both GEMM paths (the loop of torch.mm, and torch._grouped_mm where this torch
runs it on CPU), in a poisoned workspace, for zero, one, odd and full token counts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe import MoEConfigError, ModularKernel, Platform
from moe.experts.reference import ReferenceExperts
from moe.experts.torch_grouped import GroupedWeights, TorchGroupedExperts, grouped_mm_serves
from moe.formats import DispatchShape
from moe.prepare_finalize import BatchedPrepareFinalize, LocalPrepareFinalize
from moe.quant import QuantFormat
from moe.testing import PoisonedWorkspace, assert_close_moe, regime_for
from moe.workspace import WorkspaceManager
from tests.helpers import make_problem, random_inputs, random_weights

EXPERT_MAPS = {
    "all_here": None,
    "scattered": (0, -1, 1, -1, 2, 3),
    "one_here": (-1, -1, -1, 0, -1, -1),  # most slots go elsewhere; some tokens have none here
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _grouped_mm_on_cpu() -> bool:
    """Whether this torch runs ``torch._grouped_mm`` on CPU (recent versions fall back to a loop there)."""
    try:
        torch._grouped_mm(torch.ones(2, 16), torch.ones(1, 16, 16), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _problem(quant: str, expert_map, **kwargs):
    # H and I multiples of 8: rows of 16 bytes and more in bf16, as torch._grouped_mm wants
    return make_problem(quant=quant, dtype=DTYPES[quant], expert_map=expert_map, hidden_size=48,
                        intermediate_size=32, **kwargs)


def _apply_poisoned(experts, prepared, hidden, topk):
    """finalize(apply(...)) in a workspace of exactly the declared shapes, poisoned with NaN."""
    pf = LocalPrepareFinalize(experts.problem)
    dispatched, route = pf.prepare(hidden, topk, QuantFormat.NONE,
                                   WorkspaceManager().take(pf.workspace_shapes(len(hidden))))
    poisoned = PoisonedWorkspace(experts.workspace_shapes(DispatchShape(dispatched.format, dispatched.num_rows)))
    output = experts.apply(dispatched, prepared, poisoned.workspace)
    assert poisoned.violations() == [] and poisoned.holds(output.out)
    return pf.finalize(output, dispatched, route, topk)


def _reference(problem, weights, hidden, topk):
    truth = ModularKernel(LocalPrepareFinalize(problem), ReferenceExperts(problem))
    truth.load(weights)
    return truth.forward(hidden, topk)


def test_prepare_weights_builds_the_expert_map_once():
    problem = _problem("bf16", EXPERT_MAPS["scattered"])
    prepared = TorchGroupedExperts(problem).prepare_weights(random_weights(problem))
    assert isinstance(prepared, GroupedWeights)
    assert prepared.expert_map.dtype == torch.int32
    assert prepared.expert_map.tolist() == [0, -1, 1, -1, 2, 3]
    assert prepared.group_ids.tolist() == [0, 1, 2, 3]
    assert not prepared.grouped_mm  # the weights are on the CPU: the loop of torch.mm


@pytest.mark.parametrize("experts_cls", [TorchGroupedExperts, ReferenceExperts])
def test_apply_builds_no_tensor_from_host_data(experts_cls, monkeypatch):
    """The per-call ``torch.tensor(global_to_local(...))`` is gone: the map comes with the weights."""
    problem = _problem("bf16", EXPERT_MAPS["scattered"])
    weights, (hidden, topk) = random_weights(problem), random_inputs(problem, 7)
    experts = experts_cls(problem)
    prepared = experts.prepare_weights(weights)
    want = _apply_poisoned(experts, prepared, hidden, topk)

    def no_tensor(*args, **kwargs):
        raise AssertionError("torch.tensor called on the hot path")

    monkeypatch.setattr(torch, "tensor", no_tensor)
    assert torch.equal(_apply_poisoned(experts, prepared, hidden, topk), want)


def test_batched_prepare_copies_the_expert_map_once(monkeypatch):
    problem = _problem("bf16", EXPERT_MAPS["scattered"])
    pf = BatchedPrepareFinalize(problem)
    hidden, topk = random_inputs(problem, 9)
    take = lambda: WorkspaceManager().take(pf.workspace_shapes(9))  # noqa: E731
    first, _ = pf.prepare(hidden, topk, QuantFormat.NONE, take())
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: pytest.fail("torch.tensor called on a later prepare"))
    second, _ = pf.prepare(hidden, topk, QuantFormat.NONE, take())
    assert torch.equal(first.slot_rows, second.slot_rows)
    assert torch.equal(first.tokens_per_expert, second.tokens_per_expert)


def test_batched_expert_map_is_built_at_construction(monkeypatch):
    """Not on the first prepare: construction builds it on the CPU, ``load`` on another device."""
    problem = _problem("bf16", EXPERT_MAPS["scattered"])
    pf = BatchedPrepareFinalize(problem)
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: pytest.fail("torch.tensor called by prepare"))
    hidden, topk = random_inputs(problem, 9)
    first, _ = pf.prepare(hidden, topk, QuantFormat.NONE, WorkspaceManager().take(pf.workspace_shapes(9)))
    assert first.tokens_per_expert.sum() == (first.slot_rows >= 0).sum()


def test_batched_prepare_on_a_device_it_was_not_loaded_for_names_load():
    problem = _problem("bf16", EXPERT_MAPS["scattered"])
    pf = BatchedPrepareFinalize(problem)
    pf.load("meta")
    hidden, topk = random_inputs(problem, 3)
    with pytest.raises(MoEConfigError, match="tokens are on cpu but the expert map was built for meta; call "
                                             "load\\('cpu'\\) first"):
        pf.prepare(hidden, topk, QuantFormat.NONE, WorkspaceManager().take(pf.workspace_shapes(3)))


@pytest.mark.parametrize("quant", DTYPES)
@pytest.mark.parametrize("map_name", EXPERT_MAPS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grouped_mm", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _grouped_mm_on_cpu(), reason="this torch has no torch._grouped_mm on CPU"))])
def test_matches_reference_under_expert_maps(quant, map_name, bias, grouped_mm):
    problem = _problem(quant, EXPERT_MAPS[map_name], has_bias=bias, activation="swiglu_oai" if bias else "silu")
    weights = random_weights(problem)
    experts = TorchGroupedExperts(problem)
    prepared = replace(experts.prepare_weights(weights), grouped_mm=grouped_mm)
    for m in (0, 1, 7, 64):
        hidden, topk = random_inputs(problem, m)
        out = _apply_poisoned(experts, prepared, hidden, topk)
        assert_close_moe(out.float(), _reference(problem, weights, hidden, topk).float(), regime_for(problem),
                         context=f"{map_name} M={m}")


def test_tokens_with_no_expert_here_get_zeros():
    problem = _problem("fp32", EXPERT_MAPS["one_here"])
    experts = TorchGroupedExperts(problem)
    prepared = experts.prepare_weights(random_weights(problem))
    hidden, topk = random_inputs(problem, 64)
    out = _apply_poisoned(experts, prepared, hidden, topk)
    elsewhere = (topk.ids != 3).all(dim=1)  # global expert 3 is the only one here
    assert elsewhere.any() and not elsewhere.all()
    assert torch.equal(out[elsewhere], torch.zeros_like(out[elsewhere]))


def test_grouped_mm_needs_sm90_bf16_and_16_byte_rows():
    h100, aligned = Platform.preset("h100"), _problem("bf16", None)
    assert grouped_mm_serves(aligned, h100)
    assert not grouped_mm_serves(aligned, Platform.preset("a100"))
    assert not grouped_mm_serves(aligned, Platform.preset("cpu"))
    assert not grouped_mm_serves(_problem("fp32", None), h100)
    assert not grouped_mm_serves(make_problem(quant="bf16", hidden_size=36, intermediate_size=32), h100)  # 72-byte rows
    assert not grouped_mm_serves(make_problem(quant="bf16", hidden_size=48, intermediate_size=20), h100)
