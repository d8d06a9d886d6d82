"""Expert parallelism on CPU: ``all_to_all`` and ``all_to_all_batched`` over gloo, 2 and 4 processes,
against the single-process ``local + reference`` result on every rank's tokens at once.

Starting a process group costs seconds, so each group size is started once (a module fixture) and
runs every case inside; each case is then reported by its own test. A case's error is caught on every
rank and returned, so an expected error (capacity overflow) leaves the group usable for the next case
-- which is itself the proof that no rank was left waiting. A hang fails the fixture at its deadline.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.errors import MoEConfigError
from moe.prepare_finalize import LocalPrepareFinalize
from moe.prepare_finalize.all_to_all import AllToAllPrepareFinalize, BatchedAllToAllPrepareFinalize
from moe.tools.ep_demo import compare_on_rank, launch_ranks, round_robin_maps
from moe.testing import TOLERANCES, regime_for, relative_error
from tests.helpers import make_problem

TIMEOUT_S = 90  # whole group; a hang fails here instead of blocking CI
BF16 = make_problem(num_experts=8, top_k=2, max_tokens=16)


def _problem(**changes):
    return dataclasses.replace(BF16, **changes)


# name -> (problem, prepare/finalize, experts, tokens per rank, options, expected)
# expected: "exact", "close" (the scheme's tolerance), "rescaled" (twice it: a per-tensor scale is taken
# over the rows a rank receives, not over all tokens, so two different roundings meet) or the text of the
# error every rank must raise.
def _cases_2():
    fp32_k3 = make_problem(num_experts=8, top_k=3, quant="fp32", dtype=torch.float32, max_tokens=16)
    cases = {}
    for pf in ("all_to_all", "all_to_all_batched"):
        cases |= {
            f"{pf}-reference-random": (BF16, pf, "reference", (7, 5), {}, "exact"),
            f"{pf}-reference-skewed": (BF16, pf, "reference", (9, 6), {"skew_to_rank": 0}, "exact"),
            f"{pf}-reference-idle-rank": (BF16, pf, "reference", (6, 0), {}, "exact"),
            f"{pf}-reference-all-idle": (BF16, pf, "reference", (0, 0), {}, "exact"),
            f"{pf}-reference-one-token": (BF16, pf, "reference", (1, 1), {}, "exact"),
            f"{pf}-reference-round-robin-map": (BF16, pf, "reference", (7, 5), {"maps": True}, "exact"),
            f"{pf}-reference-fp8-per-token": (_fp8("fp8_token"), pf, "reference", (7, 5), {}, "exact"),
            f"{pf}-reference-fp8-per-tensor": (_fp8("fp8"), pf, "reference", (7, 5), {}, "rescaled"),
            f"{pf}-reference-fp32-k3": (fp32_k3, pf, "reference", (7, 5), {}, "close"),
        }
    cases |= {
        "all_to_all-reference-bias": (_problem(has_bias=True), "all_to_all", "reference", (7, 5), {}, "exact"),
        "all_to_all-reference-nvfp4": (make_problem(_nvfp4(), quant="nvfp4", max_tokens=16), "all_to_all",
                                       "reference", (7, 5), {}, "rescaled"),
        "all_to_all_batched-reference-mxfp8": (make_problem(_mxfp8(), quant="mxfp8", max_tokens=16),
                                               "all_to_all_batched", "reference", (7, 5), {}, "exact"),
        "all_to_all-torch_grouped-random": (BF16, "all_to_all", "torch_grouped", (7, 5), {}, "close"),
        "all_to_all-torch_grouped-skewed": (BF16, "all_to_all", "torch_grouped", (9, 6), {"skew_to_rank": 1},
                                            "close"),
        "all_to_all-torch_grouped-idle-rank": (BF16, "all_to_all", "torch_grouped", (0, 6), {}, "close"),
        "all_to_all-torch_grouped-all-idle": (BF16, "all_to_all", "torch_grouped", (0, 0), {}, "close"),
        # capacity: an expert gets 9 + 6 tokens but holds 4; then one rank alone has too many tokens
        "batched-overflow-expert": (BF16, "all_to_all_batched", "reference", (9, 6),
                                    {"skew_to_rank": 0, "max_tokens_per_expert": 4}, "max_tokens_per_expert=4"),
        "batched-overflow-rank": (BF16, "all_to_all_batched", "reference", (6, 2), {"max_tokens_per_rank": 4},
                                  "rank 0 has M=6 tokens but max_tokens_per_rank=4"),
        "batched-after-overflow": (BF16, "all_to_all_batched", "reference", (5, 3),
                                   {"max_tokens_per_expert": 8}, "exact"),
    }
    return cases


def _cases_4():
    fp32_k4 = make_problem(num_experts=8, top_k=4, quant="fp32", dtype=torch.float32, max_tokens=16)
    cases = {}
    for pf in ("all_to_all", "all_to_all_batched"):
        cases |= {
            f"{pf}-reference-random": (BF16, pf, "reference", (5, 0, 7, 3), {}, "exact"),
            f"{pf}-reference-skewed": (BF16, pf, "reference", (4, 6, 2, 5), {"skew_to_rank": 3}, "exact"),
            f"{pf}-reference-round-robin-map": (BF16, pf, "reference", (5, 2, 7, 3), {"maps": True}, "exact"),
            f"{pf}-reference-all-idle": (BF16, pf, "reference", (0, 0, 0, 0), {}, "exact"),
            f"{pf}-reference-fp32-k4": (fp32_k4, pf, "reference", (5, 1, 7, 3), {}, "close"),
        }
    cases |= {
        "all_to_all-torch_grouped-random": (BF16, "all_to_all", "torch_grouped", (5, 0, 7, 3), {}, "close"),
        "batched-overflow-expert": (BF16, "all_to_all_batched", "reference", (4, 6, 2, 5),
                                    {"skew_to_rank": 2, "max_tokens_per_expert": 8}, "max_tokens_per_expert=8"),
        "batched-after-overflow": (BF16, "all_to_all_batched", "reference", (3, 2, 1, 4), {}, "exact"),
    }
    return cases


def _fp8(quant):
    from moe.quant import QuantScheme

    return make_problem(QuantScheme.from_name(quant).weight, quant=quant, num_experts=8, top_k=2, max_tokens=16)


def _nvfp4():
    from moe.quant import QuantFormat

    return QuantFormat.NVFP4


def _mxfp8():
    from moe.quant import QuantFormat

    return QuantFormat.MXFP8


CASES = {2: _cases_2(), 4: _cases_4()}


def _run_cases(rank: int, world: int) -> dict:
    """Runs in every rank: each case's outcome, errors included."""
    results = {}
    for name, (problem, pf, experts, tokens, options, _) in CASES[world].items():
        options = dict(options)
        if options.pop("maps", False):
            options["expert_maps"] = round_robin_maps(problem.num_experts, world)
        try:
            out, truth = compare_on_rank(rank, world, problem, pf, experts, tokens, seed=len(name), **options)
        except MoEConfigError as error:
            results[name] = {"error": str(error)}
            continue
        results[name] = {
            "shape": tuple(out.shape), "dtype": str(out.dtype), "finite": bool(torch.isfinite(out).all()),
            "max_abs": (out.float() - truth.float()).abs().max().item() if out.numel() else 0.0,
            "relative": relative_error(out, truth),
            "truth_max": truth.float().abs().max().item() if truth.numel() else 0.0,
        }
    results["_probe"] = _probe_shapes(rank, world)
    results["_too_many"] = _too_many_tokens(rank, world)
    return results


class SilentAllToAll(AllToAllPrepareFinalize):
    """``all_to_all`` as a transport that cannot tell the other ranks a rank's M (as ``flashinfer_a2a``,
    whose one-sided writes exchange no counts): the kernel's fallback for those, on CPU."""

    agrees_on_tokens = False


def _too_many_tokens(rank: int, world: int) -> dict:
    """Rank 0 has max_tokens + 4 tokens, the others 5; then every rank 3. Per transport (and through an
    expert-parallel FusedMoE): each forward's outcome on this rank, and for the 5 tokens, the error against
    one process holding every expert."""
    from moe import FusedMoE, ModularKernel, ParallelConfig
    from moe.experts.reference import ReferenceExperts
    from moe.sharding import shard_weights
    from moe.tools.ep_demo import random_layer, random_tokens

    problem = dataclasses.replace(BF16, parallel=ParallelConfig(world, rank))
    full = random_layer(BF16, 2)
    single = ModularKernel(LocalPrepareFinalize(BF16), ReferenceExperts(BF16))
    single.load(full)
    outcomes = {}
    for name, pf in (("all_to_all", AllToAllPrepareFinalize), ("all_to_all_batched", BatchedAllToAllPrepareFinalize),
                     ("silent", SilentAllToAll), ("layer", None)):
        if pf is None:
            kernel = FusedMoE(BF16.num_experts, BF16.top_k, BF16.hidden_size, BF16.intermediate_size,
                              dtype=BF16.dtype, quant="bf16", max_tokens=BF16.max_tokens, experts="reference",
                              parallel=ParallelConfig(world, rank))
            local = shard_weights(full, problem)
            kernel.load_weights(w13=local.w13.data.float(), w2=local.w2.data.float())
            call = lambda h, t: kernel(h, topk=t)  # noqa: E731
        else:
            kernel = ModularKernel(pf(problem), ReferenceExperts(problem))
            kernel.load(shard_weights(full, problem))
            call = kernel.forward
        runs = []
        for tokens in ((BF16.max_tokens + 4 if rank == 0 else 5), 3):
            hidden, topk = random_tokens(BF16, tokens, 10 * rank + tokens)
            try:
                out = call(hidden, topk)
            except MoEConfigError as error:
                runs.append({"error": str(error)})
                continue
            truth = single.forward(hidden, topk)
            runs.append({"shape": tuple(out.shape), "relative": relative_error(out, truth)})
        outcomes[name] = runs
    return outcomes


def _probe_shapes(rank: int, world: int) -> dict:
    """Upper bounds and the locked workspace: what arrives never exceeds dispatch_shape, and a batched
    forward runs inside a workspace reserved and locked before the first call."""
    from moe import ModularKernel, ParallelConfig
    from moe.experts.reference import ReferenceExperts
    from moe.sharding import shard_weights
    from moe.tools.ep_demo import random_layer, random_tokens
    from moe.prepare_finalize.all_to_all import AllToAllPrepareFinalize, BatchedAllToAllPrepareFinalize
    from moe.quant import QuantFormat

    problem = dataclasses.replace(BF16, parallel=ParallelConfig(world, rank))
    weights = shard_weights(random_layer(BF16, 1), problem)
    hidden, topk = random_tokens(BF16, 16, rank, favour=[0, 1])  # all tokens to rank 0's experts
    standard = AllToAllPrepareFinalize(problem)
    arrived = standard.prepare(hidden, topk, QuantFormat.NONE, {})[0].num_rows
    batched = BatchedAllToAllPrepareFinalize(problem)
    locked = ModularKernel(batched, ReferenceExperts(problem))
    reserved = locked.reserve(lock=True)
    locked.load(weights)
    out = locked.forward(hidden, topk)
    return {"arrived": arrived, "bound": standard.dispatch_shape(16).max_rows,
            "batched_rows": batched.dispatch_shape(16).max_rows, "reserved": reserved,
            "locked_forward": tuple(out.shape), "describe": batched.describe(),
            "pf_bytes": batched.workspace_shapes(16).nbytes}


def _case_ids():
    return [(world, name) for world, cases in CASES.items() for name in cases]


@pytest.mark.parametrize("world,name", _case_ids(), ids=[f"ep{w}-{n}" for w, n in _case_ids()])
def test_case(request, world, name):
    _, ranks = request.getfixturevalue(f"group_ep{world}")
    problem, _, _, tokens, _, expected = CASES[world][name]
    for rank, results in enumerate(ranks):
        result = results[name]
        if expected not in ("exact", "close", "rescaled"):
            assert "error" in result, f"rank {rank}: expected an error containing {expected!r}, got {result}"
            assert expected in result["error"], f"rank {rank}: {result['error']}"
            continue
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["shape"] == (tokens[rank], problem.hidden_size) and result["finite"]
        assert result["dtype"] == str(problem.dtype)
        assert result["truth_max"] > 0 or tokens[rank] == 0, "an all-zero reference would prove nothing"
        if expected == "exact":
            assert result["max_abs"] == 0.0, f"rank {rank}: sharded differs from unsharded by {result['max_abs']}"
        else:
            bound = TOLERANCES[regime_for(problem)] * (2 if expected == "rescaled" else 1)
            assert result["relative"] <= bound, f"rank {rank}: relative error {result['relative']:.2e} > {bound}"


@pytest.fixture(scope="module")
def group_ep2():
    return 2, launch_ranks(_run_cases, 2, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def group_ep4():
    return 4, launch_ranks(_run_cases, 4, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("world", [2, 4])
def test_upper_bounds_and_locked_workspace(request, world):
    _, ranks = request.getfixturevalue(f"group_ep{world}")
    for rank, results in enumerate(ranks):
        probe = results["_probe"]
        assert probe["arrived"] <= probe["bound"] == world * 16
        assert probe["batched_rows"] == world * 16  # T defaults to the worst case
        assert probe["locked_forward"] == (16, BF16.hidden_size)
        assert f"{world} ranks x max_tokens_per_rank=16" in probe["describe"]
        assert f"workspace {probe['pf_bytes']:,} bytes" in probe["describe"]
        assert probe["reserved"] > probe["pf_bytes"]  # the kernel's reservation adds the experts' buffers
    # every token went to rank 0's experts: rank 0 received them all, once each
    assert ranks[0]["_probe"]["arrived"] == world * 16


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("transport", ["all_to_all", "all_to_all_batched", "layer"])
def test_too_many_tokens_on_one_rank_raise_on_every_rank_and_the_next_batch_runs(request, world, transport):
    """Issue 15's "zero hangs": M > max_tokens on rank 0 alone used to raise there before the collective and
    leave the other ranks in it; now the ranks learn every M in their exchange of counts and all raise."""
    _, ranks = request.getfixturevalue(f"group_ep{world}")
    for rank, results in enumerate(ranks):
        over, after = results["_too_many"][transport]
        assert f"rank 0 has M={BF16.max_tokens + 4} tokens but max_tokens_per_rank=16" in over.get("error", ""), over
        assert "every rank raises this" in over["error"]
        assert after["shape"] == (3, BF16.hidden_size) and after["relative"] <= TOLERANCES[regime_for(BF16)]


@pytest.mark.parametrize("world", [2, 4])
def test_a_transport_that_cannot_tell_the_others_runs_the_rank_idle_then_raises_there(request, world):
    _, ranks = request.getfixturevalue(f"group_ep{world}")
    for rank, results in enumerate(ranks):
        over, after = results["_too_many"]["silent"]
        if rank == 0:
            assert "hidden has M=20 tokens, which exceeds max_tokens=16" in over.get("error", ""), over
            assert "took part in the forward with no tokens" in over["error"]
        else:  # the others completed, their tokens served by every rank's experts (rank 0's included)
            assert over.get("shape") == (5, BF16.hidden_size), over
            assert over["relative"] <= TOLERANCES[regime_for(BF16)]
        assert after["shape"] == (3, BF16.hidden_size) and after["relative"] <= TOLERANCES[regime_for(BF16)]
