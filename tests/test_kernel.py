"""ModularKernel: composition checks, workspace accounting, input validation, M = 0."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe import (
    BatchedPrepareFinalize,
    LocalPrepareFinalize,
    MoEConfigError,
    ModularKernel,
    ReferenceExperts,
    TopK,
    TorchGroupedExperts,
    UnsupportedError,
    WorkspaceError,
    WorkspaceManager,
)
from moe.experts.base import Capabilities, Mode
from moe.formats import ActivationFormat, ExpertsOutput, OutputKind
from moe.quant import QuantFormat
from tests.helpers import make_problem, random_inputs, random_weights


def test_composition_rejects_format_mismatch():
    p = make_problem()
    with pytest.raises(MoEConfigError, match="batched format but torch_grouped takes standard"):
        ModularKernel(BatchedPrepareFinalize(p), TorchGroupedExperts(p))


def test_composition_rejects_different_problems():
    with pytest.raises(MoEConfigError, match="different MoEProblems"):
        ModularKernel(LocalPrepareFinalize(make_problem()), ReferenceExperts(make_problem(top_k=3)))


def test_composition_reports_every_problem_at_once():
    class ReducedBatched(ReferenceExperts):
        name = "test_reduced_batched"
        capabilities = Capabilities(
            formats=frozenset({ActivationFormat.BATCHED}),
            modes=Mode().serving("unquantized"),
            output=OutputKind.REDUCED,
        )

    p = make_problem()
    with pytest.raises(MoEConfigError) as info:
        ModularKernel(LocalPrepareFinalize(p), ReducedBatched(make_problem(top_k=3)))
    message = str(info.value)
    assert "different MoEProblems" in message and "produces the standard format" in message


def test_composition_rejects_unquantizable_activation_format():
    class NoQuantLocal(LocalPrepareFinalize):
        name = "test_no_quant_local"
        quant_formats = frozenset()

    p = make_problem(QuantFormat.FP8_TENSOR, quant="fp8")
    with pytest.raises(MoEConfigError, match="wants fp8_tensor activations"):
        ModularKernel(NoQuantLocal(p), ReferenceExperts(p))


def test_experts_construction_lists_all_reasons():
    p = make_problem(QuantFormat.FP8_TENSOR, quant="fp8", activation="gelu")
    with pytest.raises(UnsupportedError) as info:
        TorchGroupedExperts(p)
    assert any("quant fp8_tensor" in r for r in info.value.reasons)


def test_workspace_bytes_is_exact_and_known_before_forward():
    p = make_problem(max_tokens=64)
    kernel = ModularKernel(LocalPrepareFinalize(p), TorchGroupedExperts(p))
    expected = kernel.workspace_bytes(64)
    assert expected == kernel.workspace_shapes(64).nbytes > 0
    assert kernel.workspace.reserved_bytes == 0
    assert kernel.reserve(lock=True) == expected
    kernel.load(random_weights(p))
    hidden, topk = random_inputs(p, 64)
    kernel.forward(hidden, topk)
    assert kernel.workspace.reserved_bytes == expected  # nothing grew during the forward


def test_locked_workspace_too_small_names_caller_and_bytes():
    p = make_problem(max_tokens=64)
    kernel = ModularKernel(LocalPrepareFinalize(p), TorchGroupedExperts(p))
    kernel.reserve(8, lock=True)
    hidden, topk = random_inputs(p, 64)
    with pytest.raises(WorkspaceError, match=r"ModularKernel\(local \+ torch_grouped\) needs \d+ bytes"):
        kernel.load(random_weights(p))
        kernel.forward(hidden, topk)


def test_a_load_that_fails_leaves_the_kernel_unloaded():
    p = make_problem(max_tokens=64)
    kernel = ModularKernel(LocalPrepareFinalize(p), TorchGroupedExperts(p))
    kernel.reserve(8, lock=True)
    with pytest.raises(WorkspaceError):
        kernel.load(random_weights(p))
    with pytest.raises(MoEConfigError, match=r"has no weights: call kernel.load"):
        kernel.forward(*random_inputs(p, 3))


@pytest.mark.parametrize("pf_cls", [LocalPrepareFinalize, BatchedPrepareFinalize])
def test_zero_tokens(pf_cls):
    p = make_problem()
    kernel = ModularKernel(pf_cls(p), ReferenceExperts(p))
    hidden, topk = random_inputs(p, 0)
    kernel.load(random_weights(p))
    out = kernel.forward(hidden, topk)
    assert out.shape == (0, p.hidden_size) and out.dtype == p.dtype


def _kernel_and_inputs(m=5):
    p = make_problem(max_tokens=16)
    kernel = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p))
    hidden, topk = random_inputs(p, m)
    kernel.load(random_weights(p))
    return p, kernel, hidden, topk


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda h, t: (h[:, :-1], t), r"hidden must be \[M, 40\]"),
        (lambda h, t: (h.float(), t), "hidden must be torch.bfloat16"),
        (lambda h, t: (h.unsqueeze(0), t), r"hidden must be \[M, 40\]"),
        (lambda h, t: (h[:3], t), r"topk.ids must be \[M, top_k\] = \[3, 2\]"),
        (lambda h, t: (h, TopK(t.ids + 6, t.weights)), r"topk.ids must lie in \[0, num_experts=6\)"),
        (lambda h, t: (h, TopK(t.ids - 6, t.weights)), r"topk.ids must lie in \[0, num_experts=6\)"),
        (lambda h, t: (torch.zeros(17, 40, dtype=torch.bfloat16), TopK(torch.zeros(17, 2, dtype=torch.int32), torch.zeros(17, 2))), "exceeds max_tokens=16"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, match):
    _, kernel, hidden, topk = _kernel_and_inputs()
    hidden, topk = mutate(hidden, topk)
    with pytest.raises(MoEConfigError, match=match):
        kernel.forward(hidden, topk)


def test_batched_capacity_overflow_is_an_error():
    p = make_problem()
    kernel = ModularKernel(BatchedPrepareFinalize(p, max_tokens_per_expert=2), ReferenceExperts(p))
    hidden = torch.randn(5, p.hidden_size).to(p.dtype)
    ids = torch.tensor([[0, 1]] * 5, dtype=torch.int32)  # expert 0 gets 5 tokens, capacity 2
    topk = TopK(ids, torch.full((5, 2), 0.5))
    with pytest.raises(MoEConfigError, match="received 5 tokens but max_tokens_per_expert=2"):
        kernel.load(random_weights(p))
        kernel.forward(hidden, topk)


def test_batched_capacity_must_be_positive():
    with pytest.raises(MoEConfigError, match="max_tokens_per_expert must be a positive int"):
        BatchedPrepareFinalize(make_problem(), max_tokens_per_expert=0)


def test_local_rejects_expert_parallel_problem():
    from moe import MoEProblem, ParallelConfig

    p = MoEProblem.create(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16,
                          parallel=ParallelConfig(ep_size=2, ep_rank=0))
    assert any("ep_size=2 needs an all-to-all" in r for r in LocalPrepareFinalize.check(p, None))
    with pytest.raises(MoEConfigError, match="ep_size=2 needs an all-to-all"):
        ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p))


def test_hidden_on_another_device_is_rejected():
    _, kernel, hidden, topk = _kernel_and_inputs()
    with pytest.raises(MoEConfigError, match="hidden is on meta but the kernel was built for cpu"):
        kernel.forward(hidden.to("meta"), topk)


@pytest.mark.parametrize("pf_cls", [LocalPrepareFinalize, BatchedPrepareFinalize])
@pytest.mark.parametrize("experts_cls", [ReferenceExperts, TorchGroupedExperts])
def test_shared_output_is_added_in_finalize(pf_cls, experts_cls):
    p = make_problem(dtype=torch.float32, quant="fp32")
    if pf_cls is BatchedPrepareFinalize and experts_cls is TorchGroupedExperts:
        pytest.skip("torch_grouped takes the standard format only")
    kernel = ModularKernel(pf_cls(p), experts_cls(p))
    kernel.load(random_weights(p))
    hidden, topk = random_inputs(p, 7)
    shared = torch.randn(7, p.hidden_size)
    plain = kernel.forward(hidden, topk)
    fused = kernel.forward(hidden, topk, shared_output=shared)
    torch.testing.assert_close(fused, plain + shared)


def test_shared_output_must_match_hidden():
    _, kernel, hidden, topk = _kernel_and_inputs()
    with pytest.raises(MoEConfigError, match=r"shared_output must match hidden: \[5, 40\]"):
        kernel.forward(hidden, topk, shared_output=torch.zeros(4, 40, dtype=hidden.dtype))


def test_routed_scaling_factor_reaches_the_output_linearly():
    """The Router folds routed_scaling_factor into topk.weights, so it scales biases too, as scaling
    the summed output would (what SGLang fuses into finalize)."""
    from moe import FusedMoE

    kwargs = dict(activation="swiglu_oai", has_bias=True, dtype=torch.float32, quant="fp32")
    plain = FusedMoE(6, 2, 40, 24, **kwargs)
    scaled = FusedMoE(6, 2, 40, 24, routed_scaling_factor=2.5, **kwargs)
    dense = dict(w13=torch.randn(6, 48, 40) / 6, w2=torch.randn(6, 40, 24) / 5,
                 b13=torch.randn(6, 48) / 10, b2=torch.randn(6, 40) / 10)
    plain.load_weights(**dense)
    scaled.load_weights(**dense)
    x, logits = torch.randn(5, 40), torch.randn(5, 6)
    torch.testing.assert_close(scaled(x, logits), 2.5 * plain(x, logits))


class _RoutesFromLogits(ReferenceExperts):
    """Reference math with the softmax routing done inside apply_router_logits, output reduced."""

    name = "test_routes_from_logits"
    capabilities = Capabilities(
        formats=frozenset({ActivationFormat.STANDARD}),
        modes=Mode().serving("unquantized"),
        output=OutputKind.REDUCED,
        routes_from_logits=frozenset({"softmax"}),
    )
    calls = 0

    def apply(self, dispatched, weights, workspace):
        per_slot = super().apply(dispatched, weights, workspace).out
        return ExpertsOutput(OutputKind.REDUCED, (per_slot * dispatched.topk.weights.unsqueeze(-1)).sum(1))

    def apply_router_logits(self, hidden, router_logits, router, weights, workspace):
        type(self).calls += 1
        from moe.formats import Dispatched
        from moe.quant import QuantizedTensor

        x = QuantizedTensor(data=hidden, scale=None, fmt=QuantFormat.NONE)
        return self.apply(Dispatched(ActivationFormat.STANDARD, x, router(router_logits)), weights, workspace)


def test_routing_fused_into_the_experts_matches_the_router_path():
    from moe import Router

    p = make_problem(dtype=torch.float32, quant="fp32")
    kernel = ModularKernel(LocalPrepareFinalize(p), _RoutesFromLogits(p))
    kernel.load(random_weights(p))
    hidden, logits = torch.randn(7, p.hidden_size), torch.randn(7, p.num_experts)
    softmax, gpt_oss = Router("softmax", 6, 2), Router("gpt_oss", 6, 2)
    assert kernel.routes_in_kernel(softmax) and not kernel.routes_in_kernel(gpt_oss)
    before = _RoutesFromLogits.calls
    fused = kernel.forward_logits(hidden, logits, softmax)
    assert _RoutesFromLogits.calls == before + 1
    torch.testing.assert_close(fused, kernel.forward(hidden, softmax(logits)))
    kernel.forward_logits(hidden, logits, gpt_oss)  # not declared: the Router runs here instead
    assert _RoutesFromLogits.calls == before + 1
    with pytest.raises(MoEConfigError, match=r"router_logits must be \[M, num_experts\] = \[7, 6\]"):
        kernel.forward_logits(hidden, logits[:, :5], softmax)


def test_routing_in_the_experts_finalizes_through_finalize_reduced(monkeypatch):
    """forward_logits hands the experts' reduced ``[M, H]`` to finalize_reduced (adding shared_output
    there): neither prepare nor finalize runs, so no stand-in Dispatched is made up for them."""
    from moe import Router

    p = make_problem(dtype=torch.float32, quant="fp32")
    kernel = ModularKernel(LocalPrepareFinalize(p), _RoutesFromLogits(p))
    kernel.load(random_weights(p))
    hidden, logits, shared = torch.randn(7, p.hidden_size), torch.randn(7, p.num_experts), torch.randn(7, p.hidden_size)
    softmax = Router("softmax", 6, 2)
    want = kernel.forward(hidden, softmax(logits), shared_output=shared)
    for name in ("prepare", "finalize"):
        monkeypatch.setattr(LocalPrepareFinalize, name, lambda *a, **k: pytest.fail("called on the fused path"))
    torch.testing.assert_close(kernel.forward_logits(hidden, logits, softmax, shared_output=shared), want)


def test_finalize_reduced_serves_one_rank():
    from moe import ParallelConfig

    sharded = dataclasses.replace(make_problem(), parallel=ParallelConfig(2, 0))
    with pytest.raises(MoEConfigError, match="finalize_reduced serves one rank, not ep_size=2"):
        LocalPrepareFinalize(sharded).finalize_reduced(torch.zeros(1, sharded.hidden_size, dtype=sharded.dtype))


def test_composition_checks_the_platform_the_kernel_runs_on(monkeypatch):
    """Triton's CPU interpreter computes bfloat16 wrongly (values off by 1e10): a bf16 Triton kernel
    composed by hand on a CPU is refused with that reason instead of running."""
    from moe.experts import TritonExperts
    from moe.platform import TRITON_INTERPRETER, Platform

    interpreter = Platform.cpu().with_libraries(add=("triton",))
    interpreter = dataclasses.replace(interpreter, features=interpreter.features | {TRITON_INTERPRETER})
    monkeypatch.setattr(Platform, "detect", classmethod(lambda cls, device=None: interpreter))
    p = make_problem(dtype=torch.bfloat16, quant="bf16")
    with pytest.raises(MoEConfigError, match=r"triton on cpu: Triton's CPU interpreter computes bfloat16 wrongly"):
        ModularKernel(LocalPrepareFinalize(p), TritonExperts(p))
    # float16 is computed right there, so it composes
    p16 = make_problem(dtype=torch.float16, quant="fp16")
    assert ModularKernel(LocalPrepareFinalize(p16), TritonExperts(p16)).platform is interpreter


def test_composition_refuses_a_cuda_only_backend_on_a_cpu():
    from moe.experts import FlashInferCutlassExperts

    p = make_problem(dtype=torch.bfloat16, quant="bf16", hidden_size=128, intermediate_size=128)
    with pytest.raises(MoEConfigError, match=r"flashinfer_cutlass on cpu: runs on \['cuda'\], not cpu"):
        ModularKernel(LocalPrepareFinalize(p), FlashInferCutlassExperts(p), device="cpu")


def test_composition_takes_a_simulated_platform():
    from moe.experts import FlashInferCutlassExperts
    from moe.platform import Platform

    p = make_problem(dtype=torch.bfloat16, quant="bf16", hidden_size=128, intermediate_size=128)
    kernel = ModularKernel(LocalPrepareFinalize(p), FlashInferCutlassExperts(p), platform=Platform.preset("h100"))
    assert kernel.workspace_bytes(4) > 0


def test_forward_looks_its_bucket_up_and_sizes_nothing(monkeypatch):
    """After load, a forward only looks its bucket's views up: no half is asked for its shapes again."""
    p = make_problem(dtype=torch.float32, quant="fp32", max_tokens=64)
    weights = random_weights(p)
    fresh = ModularKernel(LocalPrepareFinalize(p), TorchGroupedExperts(p))
    fresh.load(weights)
    kernel = ModularKernel(LocalPrepareFinalize(p), TorchGroupedExperts(p))
    kernel.load(weights, buckets=(2, 8))
    assert kernel.workspace.reserved_bytes == kernel.workspace_bytes(64)  # the largest bucket: max_tokens
    for half, method in ((kernel.experts, "workspace_shapes"), (kernel.prepare_finalize, "workspace_shapes"),
                         (kernel.prepare_finalize, "dispatch_shape")):
        monkeypatch.setattr(half, method, lambda *a: pytest.fail(f"{method} asked on the hot path"))
    for m in (0, 1, 2, 3, 8, 9, 64):
        hidden, topk = random_inputs(p, m)
        torch.testing.assert_close(kernel(hidden, topk), fresh(hidden, topk))


def test_kernels_sharing_a_manager_take_their_views_again_when_it_grows():
    p = make_problem(dtype=torch.float32, quant="fp32", max_tokens=64)
    weights = random_weights(p)
    manager = WorkspaceManager("cpu")
    small = ModularKernel(LocalPrepareFinalize(dataclasses.replace(p, max_tokens=4)),
                          ReferenceExperts(dataclasses.replace(p, max_tokens=4)), workspace=manager)
    small.load(weights)
    big = ModularKernel(LocalPrepareFinalize(p), TorchGroupedExperts(p), workspace=manager)
    big.load(weights)
    grown = manager.reserved_bytes
    assert grown == big.workspace_bytes(64) > small.workspace_bytes(4)
    hidden, topk = random_inputs(p, 3)
    alone = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p))
    alone.load(weights)
    torch.testing.assert_close(small(hidden, topk), alone(hidden, topk))
    # its views now point into the manager's current buffer, not the one it replaced
    view = small._sections(3)["experts"]["out"]
    assert view.untyped_storage().data_ptr() == manager._buffer.untyped_storage().data_ptr()
    assert manager.reserved_bytes == grown


# --- the experts write the forward's result: no copy in finalize ------------------------------------


def _triton_kernel_fp32():
    pytest.importorskip("triton")
    from moe.experts.triton import TritonExperts

    p = make_problem(dtype=torch.float32, quant="fp32", max_tokens=16)
    kernel = ModularKernel(LocalPrepareFinalize(p), TritonExperts(p))
    kernel.load(random_weights(p))
    return p, kernel


def test_reduced_experts_write_a_fresh_result_that_finalize_returns(monkeypatch):
    """One rank, experts reducing into their ``"out"`` in the layer's dtype: the kernel hands them a fresh
    ``[M, H]`` tensor, finalize returns it (owned, no copy), and it lies outside the workspace, so a later
    forward cannot overwrite an earlier result."""
    p, kernel = _triton_kernel_fp32()
    seen = []
    finalize_reduced = LocalPrepareFinalize.finalize_reduced

    def spy(self, out, shared_output=None, *, owned=False):
        result = finalize_reduced(self, out, shared_output, owned=owned)
        seen.append((owned, result.data_ptr() == out.data_ptr()))
        return result

    monkeypatch.setattr(LocalPrepareFinalize, "finalize_reduced", spy)
    hidden, topk = random_inputs(p, 5)
    first = kernel.forward(hidden, topk)
    want = first.clone()
    kernel.forward(torch.randn_like(hidden), topk)
    assert seen == [(True, True), (True, True)]
    torch.testing.assert_close(first, want, rtol=0, atol=0)
    start, size = kernel.workspace._buffer.data_ptr(), kernel.workspace.reserved_bytes
    assert not start <= first.data_ptr() < start + size
    shared = torch.randn(5, p.hidden_size)
    torch.testing.assert_close(kernel.forward(hidden, topk, shared_output=shared), want + shared)


def test_an_output_other_than_the_fresh_tensor_is_copied():
    """`_owned` marks only the very tensor handed out; anything else goes through finalize's copy."""
    from moe.kernel import _owned

    fresh = torch.zeros(3, 4)
    assert _owned(ExpertsOutput(OutputKind.REDUCED, fresh), fresh).owned
    assert not _owned(ExpertsOutput(OutputKind.REDUCED, fresh.clone()), fresh).owned
    assert not _owned(ExpertsOutput(OutputKind.REDUCED, fresh[:2]), fresh).owned
    assert not _owned(ExpertsOutput(OutputKind.REDUCED, fresh), None).owned
    per_slot = torch.zeros(3, 2, 4)
    assert not _owned(ExpertsOutput(OutputKind.PER_SLOT_WEIGHTED, per_slot), fresh).owned


def test_experts_reducing_elsewhere_keep_their_workspace():
    """Experts whose output is per slot, or in float32 for a bf16 layer, get their declared buffers."""
    p = make_problem(dtype=torch.float32, quant="fp32")
    kernel = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p))  # per-slot output
    kernel.load(random_weights(p))
    hidden, topk = random_inputs(p, 4)
    space = kernel._sections(4)["experts"]
    assert kernel._experts_space(space, hidden) == (space, None)


def test_workspace_replacing_names_the_declared_buffers():
    from moe.workspace import Workspace

    space = Workspace({"out": torch.zeros(2)})
    assert space.replacing(out=torch.ones(2))["out"].sum() == 2 and space["out"].sum() == 0
    with pytest.raises(KeyError, match=r"no buffer 'inter'; declared: \['out'\]"):
        space.replacing(inter=torch.ones(2))
