"""benchmarks/ep_all_to_all.py on CPU (two gloo ranks, a scaled preset): its records (dispatch, experts,
combine) and the PrepareFinalize measurements it writes for the oracle, also through
benchmarks/make_measured_profile.py."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

from moe.oracle import load_profile

ROOT = Path(__file__).resolve().parents[1]
TRANSPORTS = ("all_to_all", "all_to_all_batched")


def _module(name: str):
    """A benchmarks/ script as a module, importable by name: the ranks are spawned processes that import
    the function they run by its module's name."""
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.append(folder)  # last: nothing installed is shadowed
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ep")
    argv = ["--device", "cpu", "--preset", "deepseek-v3", "--tokens", "1,4", "--experts", "torch_grouped,reference",
            "--json", str(folder / "ep.json"), "--save-profile", str(folder / "ep.yaml"), "--machine", "cpu-smoke",
            "--timeout", "120"]
    assert _module("ep_all_to_all").main(argv) == 0
    return json.loads((folder / "ep.json").read_text()), load_profile(folder / "ep.yaml")


def test_records_split_the_forward_into_dispatch_experts_and_combine(smoke_run):
    data, _ = smoke_run
    rows = data["records"]
    assert data["machine"] == "cpu-smoke" and data["ep"] == 2
    assert {(r["prepare_finalize"], r["experts"]) for r in rows} == {
        ("all_to_all", "torch_grouped"), ("all_to_all", "reference"), ("all_to_all_batched", "reference")}
    for r in rows:
        assert r["tokens_per_rank"] in (1, 4) and r["quant"] == "bf16" and r["preset"] == "deepseek-v3-scaled"
        assert min(r["ep_ms"], r["dispatch_ms"], r["experts_ms"], r["combine_ms"], r["single_gpu_ms"]) > 0
        # phases of forwards, not cumulative times, which would be the 20 timed forwards' sum (~20x ep_ms). The
        # phases come from other forwards than ep_ms, wrapped, on two ranks sharing 2 cores with another pytest
        # worker: a bound of 3x failed at 3.06x under that load (session 38), so the slack is half the count
        reps = inspect.signature(_module("ep_all_to_all").PhaseTimer.medians).parameters["reps"].default
        assert r["dispatch_ms"] + r["experts_ms"] + r["combine_ms"] < reps / 2 * r["ep_ms"], r
        assert r["relative_error"] <= 1e-2, r  # the sharded layer against one process holding every expert


def test_the_profile_holds_each_transport_s_smallest_time_beside_the_experts(smoke_run):
    data, profile = smoke_run
    rows = data["records"]
    assert {(e.backend, e.tokens) for e in profile.entries} == {(pf, m) for pf in TRANSPORTS for m in (1, 4)}
    for e in profile.entries:
        assert e.platform == "cpu" and e.quant == "bf16" and e.measured
        assert e.shape.ep_size == 2 and e.shape.preset is None  # a scaled preset: saved as its sizes
        assert (e.shape.num_experts, e.shape.hidden_size) == (rows[0]["shape"]["num_experts"], rows[0]["shape"]["hidden_size"])
        mine = [r for r in rows if r["prepare_finalize"] == e.backend and r["tokens_per_rank"] == e.tokens]
        assert e.measured_us == pytest.approx(min(1000 * (r["ep_ms"] - r["experts_ms"]) for r in mine))


def test_make_measured_profile_reads_an_expert_parallel_file(smoke_run, tmp_path, monkeypatch):
    data, profile = smoke_run
    maker = _module("make_measured_profile")
    (tmp_path / "ep2.json").write_text(json.dumps(data))
    monkeypatch.setattr(maker, "RESULTS", tmp_path)
    entries = maker.measurements(maker.Machine("h200", {"ep2.json": ("records", None)}, "test"))
    assert sorted((e.backend, e.tokens, e.measured_us) for e in entries) == \
        sorted((e.backend, e.tokens, e.measured_us) for e in profile.entries)
    assert {e.platform for e in entries} == {"h200"} and all(e.note == "benchmarks/results/ep2.json" for e in entries)


def test_the_phase_timer_brackets_each_phase_of_each_forward_and_restores_the_kernel():
    from moe import ModularKernel, MoEProblem, Router
    from moe.experts.reference import ReferenceExperts
    from moe.prepare_finalize import LocalPrepareFinalize
    from moe.tools.ep_demo import random_layer

    problem = MoEProblem.create(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, quant="fp32")
    kernel = ModularKernel(LocalPrepareFinalize(problem), ReferenceExperts(problem))
    kernel.load(random_layer(problem, 0))
    hidden = torch.randn(5, 64)
    topk = Router("softmax", 8, 2)(torch.randn(5, 8))
    want = kernel.forward(hidden, topk)
    timer_cls = _module("ep_all_to_all").PhaseTimer
    with timer_cls(kernel, cuda=False) as timer:
        medians = timer.medians(lambda: kernel.forward(hidden, topk), reps=4, warmup=1)
        assert torch.equal(kernel.forward(hidden, topk), want)  # timed, not changed
    assert [phase for phase, _, _ in timer.marks[:6]] == ["dispatch", "experts", "combine"] * 2
    assert len(timer.marks) == 3 * 5 and all(end >= start for _, start, end in timer.marks)
    assert set(medians) == {"dispatch_ms", "experts_ms", "combine_ms"} and min(medians.values()) >= 0
    assert "prepare" not in vars(kernel.prepare_finalize) and "apply" not in vars(kernel.experts)  # restored


def test_a_transport_s_measurement_is_its_cuda_graph_replay_where_it_captures():
    """The profile's transport time is the graph replay minus the experts where the transport captures, the
    eager forward minus the experts where it does not (all_to_all reads counts on the host); a rank without
    a graph time leaves the slowest-rank row without one."""
    from moe.platform import Platform

    bench = _module("ep_all_to_all")
    shape = {"num_experts": 16, "top_k": 4, "hidden_size": 256, "intermediate_size": 128, "activation": "silu"}
    common = {"preset": "x", "shape": shape, "quant": "bf16", "ep": 2, "experts": "triton", "tokens_per_rank": 16,
              "dispatch_ms": 0.1, "combine_ms": 0.1, "single_gpu_ms": 1.0, "single_gpu_graph_ms": 0.8,
              "relative_error": 0.0}
    per_rank = [[{**common, "rank": r, "prepare_finalize": pf, "ep_ms": 2.0 + r, "experts_ms": 1.0,
                  "ep_graph_ms": graph, "experts_graph_ms": experts_graph}
                 for pf, graph, experts_graph in (("flashinfer_a2a", 1.5 + r, 0.8), ("all_to_all", None, 0.7),
                                                  ("no_graphs", None, None))]
                for r in (0, 1)]
    rows = bench.summarize(per_rank)
    assert [(r["prepare_finalize"], r["ep_ms"], r["ep_graph_ms"], r["experts_graph_ms"]) for r in rows] == [
        ("flashinfer_a2a", 3.0, 2.5, 0.8), ("all_to_all", 3.0, None, 0.7), ("no_graphs", 3.0, None, None)]
    entries = {e.backend: e.measured_us for e in bench.transport_entries(rows, Platform.detect("cpu"))}
    # graph forward - graph experts; eager forward - graph experts; eager forward - eager experts
    assert entries == {"flashinfer_a2a": pytest.approx(1700.0), "all_to_all": pytest.approx(2300.0),
                       "no_graphs": pytest.approx(2000.0)}
    assert "| 2.500 | 0.800 |" in bench.table(rows, 2) and "| - | - |" in bench.table(rows, 2)
