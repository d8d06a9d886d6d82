"""Expert parallelism on 2 GPUs: ``all_to_all`` and ``all_to_all_batched`` over NCCL, and
``flashinfer_a2a`` over NVLink (when flashinfer is installed), with the experts that run on GPU, against
the single-GPU ``local + reference`` result on every rank's tokens at once.

Needs two CUDA devices (``nvidia-h200-x2``); one group per transport runs every case (see
tests/test_all_to_all.py for why).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moe.errors import MoEConfigError
from moe.tools.ep_demo import compare_on_rank, launch_ranks
from moe.testing import TOLERANCES, regime_for, relative_error
from tests.helpers import make_problem

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None

pytestmark = pytest.mark.gpu

PROBLEM = make_problem(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, max_tokens=64)


def _experts_here() -> list[tuple[str, str]]:
    """(prepare/finalize, experts) pairs whose experts are registered and serve PROBLEM on this GPU."""
    from moe.platform import Platform
    from moe.registry import experts_classes

    pairs = [("all_to_all", "reference"), ("all_to_all", "torch_grouped"), ("all_to_all", "triton"),
             ("all_to_all_batched", "reference"), ("all_to_all_batched", "triton_batched")]
    classes, platform = experts_classes(), Platform.detect()
    return [(pf, e) for pf, e in pairs if e in classes and not classes[e].check(PROBLEM, platform)]


# name -> (pf, experts, tokens per rank, options, expected)
def _cases() -> dict:
    cases = {}
    for pf, experts in _experts_here():
        cases |= {
            f"{pf}-{experts}-random": (pf, experts, (37, 64), {}, "close"),
            f"{pf}-{experts}-skewed": (pf, experts, (64, 21), {"skew_to_rank": 1}, "close"),
            f"{pf}-{experts}-idle-rank": (pf, experts, (0, 17), {}, "close"),
            f"{pf}-{experts}-all-idle": (pf, experts, (0, 0), {}, "close"),
        }
    cases["batched-overflow"] = ("all_to_all_batched", "reference", (40, 40),
                                 {"skew_to_rank": 0, "max_tokens_per_expert": 16}, "max_tokens_per_expert=16")
    cases["batched-after-overflow"] = ("all_to_all_batched", "reference", (5, 9), {}, "close")
    return cases


def _flashinfer_cases() -> dict:
    pairs = [("flashinfer_a2a", e) for _, e in _experts_here() if e in ("reference", "torch_grouped", "triton")]
    cases = {}
    for pf, experts in pairs:
        cases |= {
            f"{pf}-{experts}-random": (pf, experts, (37, 64), {}, "close"),
            f"{pf}-{experts}-skewed": (pf, experts, (64, 21), {"skew_to_rank": 1}, "close"),
            f"{pf}-{experts}-idle-rank": (pf, experts, (0, 17), {}, "close"),
            f"{pf}-{experts}-all-idle": (pf, experts, (0, 0), {}, "close"),
        }
    return cases


def _run(rank: int, world: int, transport: str = "nccl") -> dict:
    if transport == "flashinfer":
        import moe.prepare_finalize.flashinfer_a2a  # noqa: F401 -- registers flashinfer_a2a
    results = {}
    cases = _flashinfer_cases() if transport == "flashinfer" else _cases()
    for name, (pf, experts, tokens, options, _) in cases.items():
        try:
            out, truth = compare_on_rank(rank, world, PROBLEM, pf, experts, tokens, device="cuda", **options)
            torch.cuda.synchronize()
        except MoEConfigError as error:
            results[name] = {"error": str(error)}
            continue
        results[name] = {"shape": tuple(out.shape), "relative": relative_error(out, truth),
                         "max_abs": (out.float() - truth.float()).abs().max().item() if out.numel() else 0.0}
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


def _check(group, case, name) -> None:
    pf, experts, tokens, _, expected = case
    for rank, results in enumerate(group):
        result = results[name]
        print(f"rank {rank} {name}: {result}")
        if expected != "close":
            assert expected in result.get("error", ""), result
            continue
        assert "error" not in result, result
        assert result["shape"] == (tokens[rank], PROBLEM.hidden_size)
        assert result["relative"] <= TOLERANCES[regime_for(PROBLEM)], result
