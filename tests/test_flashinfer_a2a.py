"""``flashinfer_a2a`` without a GPU: its declaration on simulated platforms, its calls checked
against the installed FlashInfer's source (skipped without flashinfer), and its glue -- idle-rank dummy
token, sanitized padding rows, payload order, per-slot sums, combine -- run over gloo against a stand-in
``MoeAlltoAll`` that follows FlashInfer's documented semantics (and fills padding with NaN)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from moe import ParallelConfig, Platform
from moe.errors import MoEConfigError, UnsupportedError
from moe.tools.ep_demo import compare_on_rank, launch_ranks, round_robin_maps
from moe.prepare_finalize import flashinfer_a2a
from moe.prepare_finalize.flashinfer_a2a import FlashInferAllToAllPrepareFinalize, dispatch_bytes_per_token, payload_order
from moe.testing import TOLERANCES, regime_for, relative_error
from tests.helpers import make_problem

H100 = Platform(name="h100", device="cuda", capability=(9, 0), libraries=frozenset({"flashinfer"}),
                features=frozenset({"flashinfer.moe_alltoall"}))
EP2 = dataclasses.replace(make_problem(num_experts=8, top_k=2, max_tokens=16), parallel=ParallelConfig(2, 0))


# --- declaration -----------------------------------------------------------------------------------
def test_check_declares_cuda_flashinfer_and_expert_parallelism():
    cls = FlashInferAllToAllPrepareFinalize
    assert cls.check(EP2, H100) == []
    assert cls.check(EP2, H100.with_libraries(remove=("flashinfer",))) == [
        "needs library 'flashinfer', which is not installed: pip install 'moe[flashinfer]'"]
    assert cls.check(EP2, Platform.preset("cpu").with_libraries(add=("flashinfer",))) == [
        "runs on CUDA GPUs of one host joined by NVLink, not cpu"]
    assert cls.check(dataclasses.replace(EP2, parallel=ParallelConfig()), H100) == ["single rank (ep_size=1): use local"]


def test_a_flashinfer_without_moe_alltoall_is_refused_and_the_plan_takes_another_transport():
    """FlashInfer 0.7.4 has no MoeAlltoAll: the platform's probe reports the feature missing, and the
    transport is refused naming it, instead of failing when a layer is built."""
    from moe.oracle import plan

    refusal = "the installed flashinfer 0.7.4 lacks moe_alltoall"
    without = dataclasses.replace(H100, features=frozenset(), versions=(("flashinfer", "0.7.4"),))
    assert FlashInferAllToAllPrepareFinalize.check(EP2, without) == [refusal]
    h200 = Platform.preset("h200")
    assert h200.has_feature("flashinfer.moe_alltoall")  # what a simulated platform assumes (0.7.2.post1)
    versions = tuple((lib, "0.7.4" if lib == "flashinfer" else v) for lib, v in h200.versions)
    h200_074 = dataclasses.replace(h200, features=h200.features - {"flashinfer.moe_alltoall"}, versions=versions)
    pairs = {b.chosen.pair.prepare_finalize for b in plan(EP2, h200_074).buckets}
    assert "flashinfer_a2a" not in pairs and pairs <= {"all_to_all", "all_to_all_batched"}
    assert refusal in plan(EP2, h200_074).explain()


def test_the_probe_reads_moe_alltoall_from_the_package_source(tmp_path):
    """flashinfer.comm imports cuda-python, so the probe reads the file instead of importing it."""
    from moe.experts._flashinfer.library import source_features

    assert source_features(tmp_path) == frozenset()  # no comm/trtllm_moe_alltoall.py (0.7.4)
    (tmp_path / "comm").mkdir()
    module = tmp_path / "comm" / "trtllm_moe_alltoall.py"
    module.write_text("def moe_a2a_get_workspace_size_per_rank(): ...\n")
    assert source_features(tmp_path) == frozenset()  # the file without the class
    module.write_text("class MoeAlltoAll:\n    def dispatch(self): ...\n")
    assert source_features(tmp_path) == {"moe_alltoall"}


def test_the_probe_agrees_with_the_installed_flashinfer():
    from moe.experts._flashinfer.library import flashinfer_moe_features

    module = _flashinfer_file(_A2A_MODULE)
    has_class = module.is_file() and "class MoeAlltoAll" in module.read_text()
    assert ("moe_alltoall" in flashinfer_moe_features()) == has_class


def test_check_accepts_only_the_contiguous_placement():
    contiguous = ParallelConfig(2, 1).global_to_local(8)
    assert FlashInferAllToAllPrepareFinalize.check(
        dataclasses.replace(EP2, parallel=ParallelConfig(2, 1, tuple(contiguous))), H100) == []
    reasons = FlashInferAllToAllPrepareFinalize.check(
        dataclasses.replace(EP2, parallel=ParallelConfig(2, 1, round_robin_maps(8, 2)[1])), H100)
    assert reasons and "contiguously" in reasons[0]


def test_construction_errors_are_clear():
    with pytest.raises(MoEConfigError, match="init_process_group"):
        FlashInferAllToAllPrepareFinalize(EP2)
    with pytest.raises(UnsupportedError, match="contiguously"):
        FlashInferAllToAllPrepareFinalize(dataclasses.replace(EP2, parallel=ParallelConfig(2, 1, round_robin_maps(8, 2)[1])))


def test_payloads_are_ordered_so_each_stays_aligned():
    rows = 1  # the kernel checks alignment of the running byte count; one odd-sized row is the worst case
    payloads = {"x": torch.zeros(rows, 7, dtype=torch.float8_e4m3fn), "x_scale": torch.zeros(rows, 1),
                "ids": torch.zeros(rows, 3, dtype=torch.int32), "weights": torch.zeros(rows, 3)}
    order, total = payload_order(payloads), 0
    for name in order:
        total += payloads[name].numel() * payloads[name].element_size()
        assert total % payloads[name].element_size() == 0, order
    assert order[-1] == "x"


def test_dispatch_bytes_cover_the_larger_format():
    from moe.quant import QuantFormat

    fp8 = make_problem(QuantFormat.FP8_ROW, quant="fp8_token", num_experts=8, top_k=2)
    unquantized = fp8.hidden_size * 2 + 8 + 8  # bf16 rows when the experts quantize themselves
    assert dispatch_bytes_per_token(fp8) == max(unquantized, fp8.hidden_size + 4 + 8 + 8)


def test_never_touches_multicast_code():
    source = Path(inspect.getfile(flashinfer_a2a)).read_text()
    code = source.split('"""', 2)[2]  # the docstring may name what is avoided
    for name in ("allreduce", "all_reduce_fusion", "mixed_comm", "Multicast", "SymmDeviceMemory", "trtllm_ar"):
        assert name not in code, name


# --- the installed FlashInfer's signatures ---------------------------------------------------------
def _flashinfer_file(relative: str) -> Path:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        pytest.skip("flashinfer is not installed")
    return Path(spec.origin).parent / relative


_A2A_MODULE = "comm/trtllm_moe_alltoall.py"


def _skip_without_moe_alltoall():
    """Where the installed FlashInfer has no MoeAlltoAll (0.7.4) there is no call to check: the transport is
    refused (test_a_flashinfer_without_moe_alltoall_is_refused_...). The Makefile's pin has it."""
    from moe.experts._flashinfer.library import flashinfer_moe_features

    if "moe_alltoall" not in flashinfer_moe_features():
        pytest.skip("the installed flashinfer has no MoeAlltoAll; flashinfer_a2a is refused there")


def _parameters(path: Path, qualname: str) -> set[str]:
    tree = ast.parse(path.read_text())
    scope: list = tree.body
    for part in qualname.split("."):
        node = next(n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part)
        scope = node.body
    args = node.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}


@pytest.mark.parametrize("relative,qualname,used", [
    (_A2A_MODULE, "MoeAlltoAll.__init__",
     {"mapping", "max_num_tokens", "top_k", "num_experts", "workspace_size_per_rank", "mnnvl_config"}),
    (_A2A_MODULE, "MoeAlltoAll.dispatch",
     {"token_selected_experts", "input_payloads", "runtime_max_tokens_per_rank", "invalid_token_expert_id",
      "expert_id_payload_index"}),
    (_A2A_MODULE, "MoeAlltoAll.combine", {"payload", "runtime_max_tokens_per_rank"}),
    (_A2A_MODULE, "moe_a2a_get_workspace_size_per_rank",
     {"ep_size", "max_num_tokens", "total_dispatch_payload_size_per_token", "combine_payload_size_per_token"}),
    ("comm/mapping.py", "Mapping.__init__", {"world_size", "rank", "gpus_per_node", "tp_size", "moe_ep_size"}),
    ("comm/comm_backend.py", "TorchDistBackend.__init__", {"group"}),
])
def test_calls_match_the_installed_flashinfer(relative, qualname, used):
    path = _flashinfer_file(relative)
    if relative == _A2A_MODULE:
        _skip_without_moe_alltoall()
    assert used <= _parameters(path, qualname)


def test_imported_names_exist_in_the_installed_flashinfer():
    _skip_without_moe_alltoall()
    exported = _flashinfer_file("comm/__init__.py").read_text()
    assert "MoeAlltoAll as MoeAlltoAll" in exported and "moe_a2a_get_workspace_size_per_rank" in exported
    mnnvl = _flashinfer_file("comm/mnnvl.py").read_text()
    assert "class MnnvlConfig" in mnnvl and "comm_backend: Optional[CommBackend]" in mnnvl


# --- the glue, over gloo, against a stand-in for MoeAlltoAll ---------------------------------------
class StandInAlltoAll:
    """MoeAlltoAll's documented semantics over torch.distributed: a token goes once to each rank owning
    one of its experts (contiguous placement), receive buffers are ``[ep, runtime_max, *]`` whose unfilled
    rows hold garbage (NaN here) except the sanitized expert ids; combine sums each token's rows."""

    runtime_max_seen: list[int] = []  # each dispatch's runtime_max_tokens_per_rank, in this process

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank, mnnvl_config):
        self.ep, self.rank, self.group = mapping.moe_ep_size, mapping.rank, mnnvl_config.comm_backend.group
        self.max_num_tokens, self.num_experts = max_num_tokens, num_experts

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None):
        assert token_selected_experts.shape[0] >= 1, "the dispatch kernel wants a token"
        assert runtime_max_tokens_per_rank <= self.max_num_tokens
        StandInAlltoAll.runtime_max_seen.append(runtime_max_tokens_per_rank)
        owner = token_selected_experts.long() // (self.num_experts // self.ep)
        sends = torch.zeros(owner.shape[0], self.ep, dtype=torch.bool).scatter_(1, owner, True)
        self.sent = [sends[:, r].nonzero().squeeze(1) for r in range(self.ep)]
        received = []
        for payload in input_payloads:
            block = torch.full((self.ep, runtime_max_tokens_per_rank, payload.shape[1]), float("nan")).to(payload.dtype)
            for r, tokens in enumerate(self.sent):
                block[r, : len(tokens)] = payload[tokens]
            received.append(torch.empty_like(block))
            dist.all_to_all_single(received[-1], block, group=self.group)
        counts = torch.tensor([len(t) for t in self.sent])
        arrived = torch.empty_like(counts)
        dist.all_to_all_single(arrived, counts, group=self.group)
        for source, count in enumerate(arrived.tolist()):
            received[expert_id_payload_index][source, count:] = invalid_token_expert_id
        self.local_num_tokens = token_selected_experts.shape[0]
        return received

    def combine(self, payload, runtime_max_tokens_per_rank):
        back = torch.empty_like(payload)
        dist.all_to_all_single(back, payload.contiguous(), group=self.group)
        out = torch.zeros(self.local_num_tokens, payload.shape[-1])
        for r, tokens in enumerate(self.sent):
            out[tokens] += back[r, : len(tokens)].float()
        return out.to(payload.dtype)


def _stand_in_comm() -> SimpleNamespace:
    return SimpleNamespace(MoeAlltoAll=StandInAlltoAll, Mapping=lambda **kw: SimpleNamespace(**kw),
                           moe_a2a_get_workspace_size_per_rank=lambda *args: 0,
                           MnnvlConfig=lambda comm_backend: SimpleNamespace(comm_backend=comm_backend),
                           TorchDistBackend=lambda group: SimpleNamespace(group=group))


BF16 = make_problem(num_experts=8, top_k=2, max_tokens=16)
CASES = {
    "reference-random": (BF16, "reference", (7, 5), {}),
    "reference-skewed": (BF16, "reference", (9, 6), {"skew_to_rank": 1}),
    "reference-idle-rank": (BF16, "reference", (0, 6), {}),
    "reference-all-idle": (BF16, "reference", (0, 0), {}),
    "reference-fp32-k3": (make_problem(num_experts=8, top_k=3, quant="fp32", dtype=torch.float32, max_tokens=16),
                          "reference", (7, 5), {}),
    "torch_grouped-random": (BF16, "torch_grouped", (7, 5), {}),
    "torch_grouped-idle-rank": (BF16, "torch_grouped", (6, 0), {}),
}


def _run_cases(rank: int, world: int) -> dict:
    flashinfer_a2a._flashinfer_comm = _stand_in_comm  # this process only
    results = {}
    for name, (problem, experts, tokens, options) in CASES.items():
        # composed for the platform the stand-in plays: flashinfer_a2a refuses the CPU it runs on here
        out, truth = compare_on_rank(rank, world, problem, "flashinfer_a2a", experts, tokens, platform=H100, **options)
        results[name] = (tuple(out.shape), relative_error(out, truth),
                         truth.float().abs().max().item() if truth.numel() else 0.0,
                         StandInAlltoAll.runtime_max_seen[-1])
    results["_too_many"] = _too_many_tokens(rank, world)
    return results


def _too_many_tokens(rank: int, world: int) -> list[dict]:
    """Rank 0 has max_tokens + 4 tokens, the others 5; then every rank 3: each forward's outcome here."""
    from moe import ModularKernel
    from moe.experts.reference import ReferenceExperts
    from moe.prepare_finalize.local import LocalPrepareFinalize
    from moe.sharding import shard_weights
    from moe.tools.ep_demo import random_layer, random_tokens

    problem = dataclasses.replace(BF16, parallel=ParallelConfig(world, rank))
    full = random_layer(BF16, 2)
    single = ModularKernel(LocalPrepareFinalize(BF16), ReferenceExperts(BF16))
    single.load(full)
    kernel = ModularKernel(FlashInferAllToAllPrepareFinalize(problem), ReferenceExperts(problem), platform=H100)
    kernel.load(shard_weights(full, problem))
    runs = []
    for tokens in ((BF16.max_tokens + 4 if rank == 0 else 5), 3):
        hidden, topk = random_tokens(BF16, tokens, 10 * rank + tokens)
        try:
            out = kernel.forward(hidden, topk)
        except MoEConfigError as error:
            runs.append({"error": str(error)})
            continue
        runs.append({"shape": tuple(out.shape), "relative": relative_error(out, single.forward(hidden, topk)),
                     "runtime_max": StandInAlltoAll.runtime_max_seen[-1]})
    return runs


@pytest.fixture(scope="module")
def stand_in_group():
    return launch_ranks(_run_cases, 2, timeout_s=90)


def test_too_many_tokens_on_one_rank_raise_on_every_rank_and_the_next_batch_runs(stand_in_group):
    """The kernel exchanges no counts; the ranks all-reduce their M on the host before dispatch, so rank 0's
    M > max_tokens raises the same error on both ranks (no rank waits, none returns a partial result)."""
    errors = []
    for results in stand_in_group:
        over, after = results["_too_many"]
        assert f"rank 0 has M={BF16.max_tokens + 4} tokens but max_tokens_per_rank=16" in over.get("error", ""), over
        errors.append(over["error"])
        assert after["shape"] == (3, BF16.hidden_size) and after["relative"] <= TOLERANCES[regime_for(BF16)]
        # the receive buffers hold the largest M of any rank (agreed on the host), not max_tokens_per_rank=16
        assert after["runtime_max"] == 3
    assert errors[0] == errors[1]


@pytest.mark.parametrize("name", list(CASES))
def test_glue_matches_local_reference(stand_in_group, name):
    problem, _, tokens, _ = CASES[name]
    for rank, results in enumerate(stand_in_group):
        shape, relative, truth_max, runtime_max = results[name]
        assert shape == (tokens[rank], problem.hidden_size)
        assert runtime_max == max(1, *tokens)  # an idle rank's dummy token needs a row
        assert truth_max > 0 or tokens[rank] == 0
        # partial sums travel in the layer's dtype, as FlashInfer's combine takes them
        assert relative <= TOLERANCES[regime_for(problem)], f"rank {rank}: {relative:.2e}"
