"""Expert parallelism in one process: sharding, placement, capacity, the wire format, the declarations,
the construction errors, and the multi-process launcher's failure modes."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from moe import ExpertWeights, MoEProblem, ParallelConfig, Platform
from moe.errors import MoEConfigError
from moe.prepare_finalize import _ep
from moe.prepare_finalize._ep import EPCapacity, ExpertPlacement, RowCodec, quantizes_before_sending
from moe.prepare_finalize.base import batch_slots
from moe.sharding import local_expert_ids, shard_weights
from moe.tools.ep_demo import launch_ranks, round_robin_maps
from moe.prepare_finalize import LocalPrepareFinalize
from moe.prepare_finalize.all_to_all import AllToAllPrepareFinalize, BatchedAllToAllPrepareFinalize
from moe.quant import QuantFormat
from moe.registry import prepare_finalize_classes
from moe.testing.inputs import random_dense
from tests.helpers import make_problem

EP_CLASSES = (AllToAllPrepareFinalize, BatchedAllToAllPrepareFinalize)


def _sharded(problem: MoEProblem, rank: int, ep: int = 2, expert_map=None) -> MoEProblem:
    return dataclasses.replace(problem, parallel=ParallelConfig(ep, rank, expert_map))


# --- sharding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant,fmt", [("bf16", QuantFormat.NONE), ("fp8_block", QuantFormat.FP8_BLOCK),
                                       ("nvfp4", QuantFormat.NVFP4)])
def test_shard_weights_takes_each_ranks_contiguous_block(quant, fmt):
    full_problem = make_problem(fmt, quant=quant, num_experts=6, has_bias=True)
    full = ExpertWeights.from_dense(**random_dense(full_problem), quant=full_problem.quant, dtype=full_problem.dtype)
    for rank, experts in enumerate(([0, 1, 2], [3, 4, 5])):
        problem = _sharded(full_problem, rank)
        local = shard_weights(full, problem)
        local.validate(problem)  # the shard fits the sharded problem, scales and biases included
        assert torch.equal(local.w13.data.view(torch.uint8), full.w13.data[experts].view(torch.uint8))
        assert torch.equal(local.b2, full.b2[experts])
        if full.w2.global_scale is not None:
            assert torch.equal(local.w2.global_scale, full.w2.global_scale[experts])


def test_shard_weights_follows_an_explicit_map_in_local_order():
    problem = make_problem(num_experts=4, expert_map=(1, -1, 0, -1))  # local 0 = expert 2, local 1 = expert 0
    full_problem = dataclasses.replace(problem, parallel=ParallelConfig())
    full = ExpertWeights.from_dense(**random_dense(full_problem), dtype=problem.dtype)
    assert local_expert_ids(problem.parallel, 4) == [2, 0]
    assert torch.equal(shard_weights(full, problem).w2.data, full.w2.data[[2, 0]])


def test_shard_weights_wants_the_full_weights():
    problem = _sharded(make_problem(num_experts=4), 0)
    local = ExpertWeights.from_dense(**random_dense(problem), dtype=problem.dtype)  # already 2 experts
    with pytest.raises(MoEConfigError, match="full weights of all E=4 experts \\(got 2\\)"):
        shard_weights(local, problem)


# --- placement -----------------------------------------------------------------------------------
def test_placement_from_maps():
    maps = round_robin_maps(6, 3)
    placement = ExpertPlacement.from_maps([list(m) for m in maps], rank=1)
    assert placement.owner == (0, 1, 2, 0, 1, 2)
    assert placement.to_local == (-1, 0, -1, -1, 1, -1)
    assert placement.owner[placement.skip_id] != 1


@pytest.mark.parametrize("maps,match", [
    ([[0, -1], [0, -1]], "expert 0 on ranks \\[0, 1\\].*expert 1 on ranks \\[\\]"),
    ([[0, 1], [-1, -1]], "rank 0 holds every expert"),
])
def test_placement_rejects_bad_maps(maps, match):
    with pytest.raises(MoEConfigError, match=match):
        ExpertPlacement.from_maps(maps, rank=0)


# --- capacity ------------------------------------------------------------------------------------
def test_capacity_checks_the_prefill_batch_with_numbers():
    with pytest.raises(MoEConfigError, match="64 x 4 = 256 < 300; raise max_tokens_per_rank to at least 75"):
        EPCapacity(ep_size=4, max_tokens_per_rank=64, max_prefill_tokens=300)
    capacity = EPCapacity(ep_size=4, max_tokens_per_rank=64, rows_per_expert=128, max_prefill_tokens=256)
    assert capacity.rows_arriving == 256
    assert "T=128 rows per local expert" in capacity.describe(1000) and "workspace 1,000 bytes" in capacity.describe(1000)


def test_capacity_overflow_names_rank_and_expert():
    capacity = EPCapacity(ep_size=2, max_tokens_per_rank=8, rows_per_expert=4)
    reasons = capacity.overflow(loads=[5, 0, 2, 9], tokens=[9, 3], owner=(0, 0, 1, 1))
    assert reasons == ["rank 0 has M=9 tokens but max_tokens_per_rank=8",
                       "expert 3 (on rank 1) would receive 9 tokens but max_tokens_per_expert=4",
                       "expert 0 (on rank 0) would receive 5 tokens but max_tokens_per_expert=4"]
    assert capacity.overflow(loads=[4, 4, 0, 0], tokens=[8, 0], owner=(0, 0, 1, 1)) == []


@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_capacity_rejects_non_positive_sizes(value):
    with pytest.raises(MoEConfigError, match="max_tokens_per_rank must be a positive int"):
        EPCapacity(ep_size=2, max_tokens_per_rank=value)


# --- wire format ---------------------------------------------------------------------------------
def test_row_codec_round_trips_every_field():
    codec = RowCodec.for_activations(4096, torch.bfloat16, QuantFormat.NONE, 8)
    assert codec.row_bytes == 8192 + 32 + 32  # the docstring's example
    fp8 = RowCodec.for_activations(256, torch.bfloat16, QuantFormat.FP8_ROW, 2)
    assert [name for name, _, _ in fp8.fields] == ["x", "x_scale", "ids", "weights"]
    for rows in (0, 3):
        values = {"x": torch.randn(rows, 256).to(torch.float8_e4m3fn), "x_scale": torch.rand(rows, 1),
                  "ids": torch.randint(0, 9, (rows, 2), dtype=torch.int32), "weights": torch.rand(rows, 2)}
        back = fp8.unpack(fp8.pack(values))
        for name, tensor in values.items():
            assert torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("fmt,before", [
    (QuantFormat.NONE, False), (QuantFormat.FP8_TENSOR, False), (QuantFormat.NVFP4, False),
    (QuantFormat.FP8_ROW, True), (QuantFormat.FP8_BLOCK, True), (QuantFormat.MXFP8, True),
])
def test_only_per_row_scales_are_quantized_before_sending(fmt, before):
    assert quantizes_before_sending(fmt, 256, torch.bfloat16) is before


def test_batch_slots_place_rows_in_order_and_skip_other_ranks():
    local = torch.tensor([[0, -1], [1, 0], [-1, -1], [0, 1]])
    rows, counts = batch_slots(local, num_local=2, capacity=4)
    assert rows.tolist() == [[0, -1], [4, 1], [-1, -1], [2, 5]]
    assert counts.tolist() == [3, 2] and counts.dtype == torch.int32


# --- declarations and construction --------------------------------------------------------------
def test_registered_under_their_names():
    classes = prepare_finalize_classes()
    assert classes["all_to_all"] is AllToAllPrepareFinalize
    assert classes["all_to_all_batched"] is BatchedAllToAllPrepareFinalize


@pytest.mark.parametrize("cls", EP_CLASSES)
def test_check_sends_single_rank_problems_to_local(cls):
    single, sharded = make_problem(), _sharded(make_problem(), 1)
    assert cls.check(single, Platform.cpu()) == ["single rank (ep_size=1): use local"]
    assert cls.check(sharded, Platform.cpu()) == [] == cls.check(sharded, None)
    assert LocalPrepareFinalize.check(sharded, None)  # so the oracle can only pick an all-to-all here


@pytest.mark.parametrize("cls", EP_CLASSES)
def test_construction_without_torch_distributed_is_a_clear_error(cls):
    assert not torch.distributed.is_initialized()
    with pytest.raises(MoEConfigError, match="init_process_group"):
        cls(_sharded(make_problem(), 0))


def test_capacity_is_checked_before_the_process_group():
    problem = _sharded(make_problem(max_tokens=64), 0)
    with pytest.raises(MoEConfigError, match="64 x 2 = 128 < 200"):
        AllToAllPrepareFinalize(problem, max_prefill_tokens=200)
    with pytest.raises(MoEConfigError, match="max_tokens_per_rank=65 exceeds the problem's max_tokens=64"):
        BatchedAllToAllPrepareFinalize(problem, max_tokens_per_rank=65)


def _constructed_alone(monkeypatch, cls, problem: MoEProblem, **options):
    """An expert-parallel prepare/finalize built in one process: the group's calls are stubbed, the
    placement comes from every rank's default map."""
    ep, num_experts = problem.parallel.ep_size, problem.num_experts
    maps = [ParallelConfig(ep, r).global_to_local(num_experts) for r in range(ep)]
    monkeypatch.setattr(_ep, "process_group", lambda parallel, who: None)
    monkeypatch.setattr(_ep, "comm_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(_ep.ExpertPlacement, "gather",
                        classmethod(lambda c, p, group: c.from_maps(maps, p.parallel.ep_rank)))
    return cls(problem, **options)


@pytest.mark.parametrize("cls", EP_CLASSES)
def test_codecs_and_buffers_are_built_at_construction(cls, monkeypatch):
    problem = _sharded(make_problem(QuantFormat.FP8_ROW, quant="fp8_token"), 1)
    pf = _constructed_alone(monkeypatch, cls, problem)
    for name in ("row_layout", "quantizes_before_sending"):
        monkeypatch.setattr(_ep, name, lambda *a, **k: pytest.fail("a row layout computed after construction"))
    monkeypatch.setattr(_ep.RowCodec, "for_activations", lambda *a, **k: pytest.fail("a codec built per call"))
    wires = {fmt: pf._wire(fmt) for fmt in (QuantFormat.NONE, QuantFormat.FP8_ROW)}
    assert {fmt: wire for fmt, (wire, _) in wires.items()} == {QuantFormat.NONE: QuantFormat.NONE,
                                                               QuantFormat.FP8_ROW: QuantFormat.FP8_ROW}
    assert wires[QuantFormat.FP8_ROW][1].field_bytes("x_scale") == 4
    assert pf.workspace_shapes(3).nbytes == pf.workspace_shapes(problem.max_tokens).nbytes
    assert pf.describe().startswith(f"{cls.name}: EP capacity")
    with pytest.raises(MoEConfigError, match="quantizes to none or the problem's activation format fp8_row "
                                             "\\(got quantize_to=QuantFormat.MXFP8\\)"):
        pf._wire(QuantFormat.MXFP8)


# --- the launcher never hangs -------------------------------------------------------------------
def _one_rank_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke before the collective")
    torch.distributed.all_reduce(torch.ones(1))  # rank 0 waits for a peer that never comes


def test_a_failing_rank_is_reported_and_the_others_are_stopped():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 broke before the collective"):
        launch_ranks(_one_rank_fails, 2, timeout_s=60)
    assert time.monotonic() - start < 30
