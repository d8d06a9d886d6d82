"""`python -m moe tune` and TMA-A tiles: the search space offers them where they can run, the launches
it times are the path `TritonExperts` runs (row gather, then both operands by TMA), and the tile pairs
it ranks are configs `LaunchConfig` accepts. The launches run on the CPU under TRITON_INTERPRET=1."""

import dataclasses

import pytest
import torch

from moe.experts._triton.config import LaunchConfig, TileConfig
from moe.experts._triton.gemm import LaunchSequence, grouped_gemm_reference
from moe.experts.triton import TritonExperts
from moe.tools import tune
from tests.test_triton import make_problem, make_topk, make_weights


@pytest.mark.parametrize("scheme", ["bf16", "fp16"])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("wide", [False, True])
def test_dense_16_bit_blocks_of_64_rows_get_tma_a_twins_of_their_tma_tiles(scheme, block_m, wide):
    tiles = tune.candidate_tiles(block_m, wide, scheme, rows_per_expert=300)
    tma_a = [t for t in tiles if t.tma_a]
    assert tma_a and all(t.tma and t.block_k <= 128 for t in tma_a)
    # each is a TMA tile of the list with A by TMA too; each TMA tile has its twin, but a gated 256-wide one
    tma = [t for t in tiles if t.tma and not t.tma_a]
    assert {dataclasses.replace(t, tma_a=False) for t in tma_a} == {t for t in tma if wide or t.block_n < 256}
    assert not [t for t in tma_a if not wide and t.block_n >= 256]  # gated: two 256-wide W tiles overflow shared memory
    assert {t.num_warps for t in tma_a} <= {4, 8} and (block_m == 128 or {t.num_warps for t in tma_a} == {4, 8})


@pytest.mark.parametrize("scheme,block_m", [("mxfp4", 128), ("fp8_block", 128), ("fp32", 128), ("fp8", 64),
                                            ("bf16", 16), ("bf16", 32), ("fp16", 32)])
def test_no_tma_a_tiles_for_quantized_fp32_or_small_blocks(scheme, block_m):
    for wide in (False, True):
        assert not [t for t in tune.candidate_tiles(block_m, wide, scheme, rows_per_expert=300) if t.tma_a]


PLAIN, PLAIN_FAST = TileConfig(64, 64, tma=True), TileConfig(128, 64, tma=True)
TMA_A, TMA_A_FAST = TileConfig(64, 64, tma=True, tma_a=True), TileConfig(128, 64, tma=True, tma_a=True)


def test_tile_pairs_never_feed_a_tma_a_second_gemm_from_a_pointer_first_gemm():
    """The fastest second tile is TMA-A but the fastest first one is not: that pair is refused by
    `LaunchConfig`, so the plain first tile takes the fastest plain second tile, and the fastest TMA-A
    first tile the TMA-A second one. A tile that did not run (inf) is never picked."""
    times1 = {PLAIN_FAST: 10.0, TMA_A: 12.0, TMA_A_FAST: float("inf")}
    times2 = {PLAIN: 9.0, TMA_A_FAST: 7.0, PLAIN_FAST: float("inf")}
    pairs = tune.tile_pairs(times1, times2)
    assert pairs == [(19.0, PLAIN_FAST, PLAIN), (19.0, TMA_A, TMA_A_FAST)]
    for _, tile1, tile2 in pairs:
        LaunchConfig(128, tile1, tile2)  # accepted
    # the fastest first tile is TMA-A: one pair, with the fastest second tile of all
    assert tune.tile_pairs({TMA_A: 5.0, PLAIN: 6.0}, times2) == [(12.0, TMA_A, TMA_A_FAST)]
    # nothing a plain first tile can feed, and no TMA-A first tile: no pair
    assert tune.tile_pairs({PLAIN: 5.0}, {TMA_A: 1.0}) == []
    assert tune.tile_pairs({PLAIN: float("inf")}, {PLAIN: 1.0}) == []


def tma_a_case(tokens=9):
    torch.manual_seed(0)
    p = make_problem("fp16", "silu", E=4, k=2, H=64, I=48, max_tokens=tokens)
    experts = TritonExperts(p)
    weights = experts.prepare_weights(make_weights(p))
    hidden = torch.randn(tokens, p.hidden_size).half()
    return tune.TuneCase(p, experts, weights, [(hidden, make_topk(tokens, p))])


def segments(sorted_slots, ends, counts, block_m):
    """(sorted row, its local expert, its slot) of every row that holds a slot."""
    for e, (end, count) in enumerate(zip(ends.tolist(), counts.tolist())):
        first = end - -(-count // block_m) * block_m
        for r in range(first, first + count):
            yield r, e, int(sorted_slots[r])


def test_tune_times_the_tma_a_path_gather_then_both_gemms_by_tma():
    """The tuner's launches for a TMA-A tile: GEMM1 is the row gather then the TMA-A kernel writing the
    sorted intermediate (equal to the pointer tile's rows, row by slot), GEMM2 the TMA-A kernel from
    the sorted intermediate to the slots' rows (equal to the float32 reference); every kernel among
    them is in the precompile list."""
    case = tma_a_case()
    block_m, plain, tma_a = 16, TileConfig(32, 32, tma=True), TileConfig(32, 32, tma=True, tma_a=True)
    first, second, aligns = tune.gemm_launches(case, block_m, False, [plain, tma_a], [plain, tma_a],
                                               torch.device("cpu"))
    assert len(aligns) == 1 and isinstance(first[tma_a][0], LaunchSequence)
    gather, gemm1 = first[tma_a][0].launches
    assert (gather.kernel[1], gemm1.kernel[1], second[tma_a][0].kernel[1]) == (
        "gather_rows_kernel", "moe_gemm_tma_a_kernel", "moe_gemm_tma_a_kernel")
    kernels = {spec[3] for spec in tune.distinct_kernels([first, second])}
    assert kernels == {("gemm", "moe_gemm_kernel"), ("gemm_tma_a", "gather_rows_kernel"),
                       ("gemm_tma_a", "moe_gemm_tma_a_kernel")}
    aligns[0]()
    first[plain][0].run()
    by_slot = first[plain][0].args[7].float().clone()  # the pointer tile's output: the intermediate by slot
    first[tma_a][0].run()
    inter_sorted, sorted_slots, ends, counts = gemm1.args[3], *gemm1.args[4:7]
    rows = list(segments(sorted_slots, ends, counts, block_m))
    assert len(rows) == case.inputs[0][0].shape[0] * case.problem.top_k
    r, e, s = (torch.tensor(c) for c in zip(*rows))
    torch.testing.assert_close(inter_sorted[r].float(), by_slot[s], atol=5e-3, rtol=5e-3)
    second[tma_a][0].run()
    y = second[tma_a][0].args[3]
    want = grouped_gemm_reference(inter_sorted[r], case.weights.w2.data, None, e, None)
    torch.testing.assert_close(y[s].float(), want, atol=5e-3, rtol=5e-3)


def test_time_configs_takes_turns_and_keeps_each_configs_median(monkeypatch):
    """`tune.time_configs` times the configs in turns (A, B, A, B, ...), each turn with only that config in the
    table, and returns each config's median round in the configs' order."""
    first, second = LaunchConfig(16, TileConfig(32, 64), TileConfig(32, 64)), LaunchConfig(32, TileConfig(64, 64),
                                                                                           TileConfig(64, 64))
    turns, us = [], {first: iter([5.0, 1.0, 3.0]), second: iter([2.0, 9.0, 4.0])}

    def calls(cls, problem, weights, inputs, device, *, experts, prepared):
        ((m, config),) = prepared.configs.configs  # the table holds the timed config alone, at the case's M
        assert m == 7
        return config

    def timed(config, graphs):
        turns.append(config)
        return next(us[config])

    monkeypatch.setattr(tune, "backend_calls", calls)
    monkeypatch.setattr(tune, "time_calls", timed)
    weights = dataclasses.make_dataclass("W", ["configs"])(tune.ConfigTable(None))
    case = tune.TuneCase(problem=None, experts=None, weights=weights, inputs=[(torch.zeros(7, 4), None)])
    assert tune.time_configs(case, [first, second], rounds=3) == [3.0, 4.0]
    assert turns == [first, second] * 3
