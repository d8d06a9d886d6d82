"""The combination matrix: every PrepareFinalize x Experts pair valid on this machine, generated from
the capability declarations, against ``local + reference`` for each scheme and activation it declares."""

from __future__ import annotations

import pytest
import torch

from moe import ModularKernel, Platform
from moe.experts.reference import ReferenceExperts, reference_for
from moe.compose import composition_problems
from moe.prepare_finalize import LocalPrepareFinalize
from moe.quant import QuantFormat
from moe.registry import experts_classes, prepare_finalize_classes
from moe.testing import assert_close_moe, regime_for
from tests.helpers import make_problem, random_inputs, random_weights

PLATFORM = Platform.detect()
SCHEME_OF_PAIR = {
    (QuantFormat.NONE, QuantFormat.NONE): "bf16",
    (QuantFormat.FP8_TENSOR, QuantFormat.FP8_TENSOR): "fp8",
    (QuantFormat.FP8_ROW, QuantFormat.FP8_ROW): "fp8_token",
    (QuantFormat.FP8_BLOCK, QuantFormat.FP8_BLOCK): "fp8_block",
    (QuantFormat.MXFP8, QuantFormat.MXFP8): "mxfp8",
    (QuantFormat.MXFP4, QuantFormat.NONE): "mxfp4",
    (QuantFormat.MXFP4, QuantFormat.MXFP8): "mxfp4_a_mxfp8",
    (QuantFormat.NVFP4, QuantFormat.NVFP4): "nvfp4",
}
TOKENS = (0, 1, 7, 64)


def _scheme(pair):
    name = SCHEME_OF_PAIR[pair]
    if name == "mxfp4_a_mxfp8":
        from moe.quant import QuantScheme

        return QuantScheme.from_name("mxfp4", act_quant="mxfp8")
    return name


def _cases():
    """(pf name, experts name, problem) for every pair the declarations say can run here."""
    for pf_name, pf_cls in prepare_finalize_classes().items():
        for ex_name, ex_cls in experts_classes().items():
            cap = ex_cls.capabilities
            for pair in sorted(cap.quant, key=str):
                for act in sorted(cap.activations, key=str):
                    for has_bias in (False, True) if cap.bias else (False,):
                        problem = make_problem(pair[0], quant=_scheme(pair), activation=act.value, has_bias=has_bias)
                        if ex_cls.check(problem, PLATFORM) or pf_cls.check(problem, PLATFORM):
                            continue
                        if composition_problems(pf_cls, ex_cls, problem, PLATFORM):
                            continue
                        yield pytest.param(pf_name, ex_name, problem,
                                           id=f"{pf_name}-{ex_name}-{SCHEME_OF_PAIR[pair]}-{act.value}-bias{int(has_bias)}")


CASES = list(_cases())


def test_matrix_is_not_empty():
    names = {(c.values[0], c.values[1]) for c in CASES}
    assert ("local", "reference") in names and ("batched", "reference") in names
    assert ("local", "torch_grouped") in names


@pytest.mark.parametrize("pf_name,experts_name,problem", CASES)
def test_pair_matches_reference(pf_name, experts_name, problem):
    pf_cls, ex_cls = prepare_finalize_classes()[pf_name], experts_classes()[experts_name]
    kernel = ModularKernel(pf_cls(problem), ex_cls(problem))
    truth = ModularKernel(LocalPrepareFinalize(problem), reference_for(ex_cls, problem, PLATFORM)(problem))
    weights = random_weights(problem)
    kernel.load(weights), truth.load(weights)
    for m in TOKENS:
        hidden, topk = random_inputs(problem, m)
        out = kernel.forward(hidden, topk)
        ref = truth.forward(hidden, topk)
        assert out.shape == (m, problem.hidden_size) and out.dtype == problem.dtype
        if m:
            assert ref.abs().max() > 0, "reference output is all zeros: the comparison would prove nothing"
        assert_close_moe(out.float(), ref.float(), regime_for(problem), context=f"M={m}")


@pytest.mark.parametrize("experts_name", ["reference", "torch_grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_expert_map_drops_remote_experts(experts_name, dtype):
    """Experts mapped to -1 contribute nothing; the rest match a full layer restricted to them."""
    expert_map = (0, -1, 1, -1, 2, 3)  # 4 of 6 experts live here
    quant = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    full = make_problem(quant=quant, dtype=dtype)
    sharded = make_problem(quant=quant, dtype=dtype, expert_map=expert_map)
    full_weights = random_weights(full)
    local_ids = [g for g, l in enumerate(expert_map) if l >= 0]
    cls = experts_classes()[experts_name]
    kernel = ModularKernel(LocalPrepareFinalize(sharded), cls(sharded))
    kernel.load(full_weights.select_experts(local_ids))
    hidden, topk = random_inputs(full, 33)
    out = kernel.forward(hidden, topk)
    # truth: the full layer with the router weights of remote experts zeroed
    remote = torch.tensor([l < 0 for l in expert_map])[topk.ids.long()]
    masked = type(topk)(topk.ids, torch.where(remote, 0.0, topk.weights))
    truth = ModularKernel(LocalPrepareFinalize(full), ReferenceExperts(full))
    truth.load(full_weights)
    ref = truth.forward(hidden, masked)
    assert_close_moe(out.float(), ref.float(), regime_for(full))
