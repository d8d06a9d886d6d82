"""Expert parallelism on 2 GPUs: ``all_to_all`` and ``all_to_all_batched`` over NCCL, and
``flashinfer_a2a`` over NVLink (when flashinfer is installed), with the experts that run on GPU (the
reference, torch_grouped, triton, flashinfer_cutlass), against the single-GPU ``local + reference`` result on
every rank's tokens at once: random, skewed, idle ranks, one token, GPT-OSS biases, fp8 per-token rows on
the wire; and a rank with too many tokens, which must leave no rank waiting.

Needs two CUDA devices (``nvidia-h200-x2``); one group per transport runs every case (see
tests/test_all_to_all.py for why).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moe.errors import MoEConfigError
from moe.quant import QuantFormat
from moe.router import TopK
from moe.tools.ep_demo import compare_on_rank, launch_ranks
from moe.testing import TOLERANCES, regime_for, relative_error
from tests.helpers import make_problem

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None

pytestmark = pytest.mark.gpu

PROBLEM = make_problem(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, max_tokens=64)
# GPT-OSS's expert kind (biases, the clamped SwiGLU), and fp8 per-token activations: the reference experts
# take them quantized, so they travel as fp8 rows with their scales
GPT_OSS = make_problem(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, max_tokens=64,
                       activation="swiglu_oai", has_bias=True)
FP8_TOKEN = make_problem(QuantFormat.FP8_ROW, quant="fp8_token", num_experts=16, top_k=4, hidden_size=256,
                         intermediate_size=128, max_tokens=64)
EXPERTS = ("reference", "torch_grouped", "triton", "flashinfer_cutlass")


def _serves(experts: str, problem) -> bool:
    from moe.platform import Platform
    from moe.registry import experts_classes

    classes = experts_classes()
    return experts in classes and not classes[experts].check(problem, Platform.detect())


def _transport_cases(pf: str, experts_names) -> dict:
    """name -> (problem, pf, experts, tokens per rank, options, expected) for one transport."""
    cases = {}
    for experts in experts_names:
        if not _serves(experts, PROBLEM):
            continue
        cases |= {
            f"{pf}-{experts}-random": (PROBLEM, pf, experts, (37, 64), {}, "close"),
            f"{pf}-{experts}-skewed": (PROBLEM, pf, experts, (64, 21), {"skew_to_rank": 1}, "close"),
            f"{pf}-{experts}-idle-rank": (PROBLEM, pf, experts, (0, 17), {}, "close"),
            f"{pf}-{experts}-all-idle": (PROBLEM, pf, experts, (0, 0), {}, "close"),
            f"{pf}-{experts}-one-token": (PROBLEM, pf, experts, (1, 0), {}, "close"),
            f"{pf}-{experts}-one-token-each": (PROBLEM, pf, experts, (1, 1), {}, "close"),
        }
        if _serves(experts, GPT_OSS):
            cases[f"{pf}-{experts}-gpt-oss-bias"] = (GPT_OSS, pf, experts, (37, 21), {}, "close")
    for experts in ("reference", "triton"):  # the experts that take fp8 per-token rows (quantized before sending)
        if _serves(experts, FP8_TOKEN):
            cases[f"{pf}-{experts}-fp8-per-token-wire"] = (FP8_TOKEN, pf, experts, (37, 21), {}, "close")
    return cases


# name -> (problem, pf, experts, tokens per rank, options, expected)
def _cases() -> dict:
    cases = _transport_cases("all_to_all", EXPERTS)
    for experts in ("reference", "triton_batched"):
        if _serves(experts, PROBLEM):
            cases |= {
                f"all_to_all_batched-{experts}-random": (PROBLEM, "all_to_all_batched", experts, (37, 64), {}, "close"),
                f"all_to_all_batched-{experts}-idle-rank": (PROBLEM, "all_to_all_batched", experts, (0, 17), {},
                                                             "close"),
            }
    cases["batched-overflow"] = (PROBLEM, "all_to_all_batched", "reference", (40, 40),
                                 {"skew_to_rank": 0, "max_tokens_per_expert": 16}, "max_tokens_per_expert=16")
    cases["batched-after-overflow"] = (PROBLEM, "all_to_all_batched", "reference", (5, 9), {}, "close")
    return cases


def _flashinfer_cases() -> dict:
    return _transport_cases("flashinfer_a2a", EXPERTS)


def _too_many(rank: int, transport: str) -> list[dict]:
    """Rank 0 has max_tokens + 4 tokens, rank 1 has 5; then both 3: each forward's outcome on this rank."""
    import dataclasses

    from moe import ModularKernel, ParallelConfig
    from moe.experts.reference import ReferenceExperts
    from moe.registry import get_prepare_finalize
    from moe.sharding import shard_weights
    from moe.tools.ep_demo import random_layer, random_tokens

    problem = dataclasses.replace(PROBLEM, parallel=ParallelConfig(2, rank))
    kernel = ModularKernel(get_prepare_finalize(transport)(problem), ReferenceExperts(problem), device="cuda")
    kernel.load(shard_weights(random_layer(PROBLEM, 3), problem).to("cuda"))
    runs = []
    for tokens in ((PROBLEM.max_tokens + 4 if rank == 0 else 5), 3):
        hidden, topk = random_tokens(PROBLEM, tokens, 10 * rank + tokens)
        try:
            out = kernel.forward(hidden.cuda(), TopK(topk.ids.cuda(), topk.weights.cuda()))
            torch.cuda.synchronize()
            runs.append({"shape": tuple(out.shape)})
        except MoEConfigError as error:
            runs.append({"error": str(error)})
    return runs


def _run(rank: int, world: int, transport: str = "nccl") -> dict:
    if transport == "flashinfer":
        import moe.prepare_finalize.flashinfer_a2a  # noqa: F401 -- registers flashinfer_a2a
    results = {}
    cases = _flashinfer_cases() if transport == "flashinfer" else _cases()
    for name, (problem, pf, experts, tokens, options, _) in cases.items():
        try:
            out, truth = compare_on_rank(rank, world, problem, pf, experts, tokens, device="cuda", **options)
            torch.cuda.synchronize()
        except MoEConfigError as error:
            results[name] = {"error": str(error)}
            continue
        results[name] = {"shape": tuple(out.shape), "relative": relative_error(out, truth),
                         "max_abs": (out.float() - truth.float()).abs().max().item() if out.numel() else 0.0}
    results["_too_many"] = _too_many(rank, "flashinfer_a2a" if transport == "flashinfer" else "all_to_all")
    return results


@pytest.fixture(scope="module")
def nccl_group():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    return launch_ranks(_run, 2, backend="nccl", timeout_s=240)


@pytest.fixture(scope="module")
def flashinfer_group():
    if torch.cuda.device_count() < 2 or not HAS_FLASHINFER:
        pytest.skip("needs 2 CUDA devices and flashinfer")
    return launch_ranks(_run, 2, ("flashinfer",), backend="nccl", timeout_s=240)


@pytest.mark.parametrize("name", list(_cases()) if torch.cuda.is_available() else ["none"])
def test_two_gpus_match_one(nccl_group, name):
    _check(nccl_group, _cases()[name], name)


@pytest.mark.parametrize("name", list(_flashinfer_cases()) if torch.cuda.is_available() else ["none"])
def test_flashinfer_two_gpus_match_one(flashinfer_group, name):
    _check(flashinfer_group, _flashinfer_cases()[name], name)


def test_too_many_tokens_on_one_rank_hang_no_rank(nccl_group):
    """all_to_all: every rank raises the same error, then both run the next batch."""
    assert nccl_group[0]["_too_many"][0] == nccl_group[1]["_too_many"][0]
    for rank, results in enumerate(nccl_group):
        over, after = results["_too_many"]
        assert "rank 0 has M=68 tokens but max_tokens_per_rank=64" in over.get("error", ""), over
        assert after == {"shape": (3, PROBLEM.hidden_size)}


def test_flashinfer_too_many_tokens_on_one_rank_hang_no_rank(flashinfer_group):
    """flashinfer_a2a: the ranks all-reduce their M on the host before dispatch; both raise the same error."""
    over0, after0 = flashinfer_group[0]["_too_many"]
    over1, after1 = flashinfer_group[1]["_too_many"]
    assert "rank 0 has M=68 tokens but max_tokens_per_rank=64" in over0.get("error", ""), over0
    assert over0 == over1
    assert after0 == after1 == {"shape": (3, PROBLEM.hidden_size)}


def _check(group, case, name) -> None:
    problem, pf, experts, tokens, _, expected = case
    for rank, results in enumerate(group):
        result = results[name]
        print(f"rank {rank} {name}: {result}")
        if expected != "close":
            assert expected in result.get("error", ""), result
            continue
        assert "error" not in result, result
        assert result["shape"] == (tokens[rank], problem.hidden_size)
        assert result["relative"] <= TOLERANCES[regime_for(problem)], result
