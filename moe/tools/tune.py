"""``python -m moe tune``: search the Triton experts' launch configs and write them as data files.

For each token count M (a bucket), every candidate BLOCK_M is tried; for each, the tiles of the two
GEMMs are timed separately (CUDA-graph replays, two input sets with different routing rotated so
the weights are not all cache-hot); the three best plans and the table's current config for M are
then timed end to end, taking turns; the two fastest and their neighbours (a store, a loader, a group size or
a ring depth changed) are timed again in a round of their own with the current config, and the fastest replaces
the current one only where it is faster by `MARGIN` there and again in a head to head (so a re-tune never makes
a bucket slower). All candidate kernels are compiled first, in parallel worker processes, into Triton's on-disk
cache. ``--refine`` skips the
tile search: each bucket's current config, the warp-specialized candidates and the neighbourhood only. The result
is one `ConfigTable` file per (shape, scheme, device) in ``triton/`` of the tuning cache (``moe.cache``;
the packaged ``moe/experts/_triton/configs/`` when the cache is off, or ``--out``), which
`TritonExperts` loads at ``prepare_weights``. A progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moe.errors import MoEConfigError, UnsupportedError
from moe.experts._triton.align import align_block_size
from moe.experts._triton.config import CONFIG_DIR, ConfigTable, LaunchConfig, TileConfig, triton_cache_dir
from moe.experts._triton.gemm import DirectRows, LaunchSequence, SortedRows, gemm_launch, precompile
from moe.experts._triton.gemm_tma_a import gather_launch, tma_a_gemm_launch
from moe.experts._triton.gemm_wgmma import check_wgmma_operands
from moe.experts._triton.gemm_ws import check_shared_memory, fits_shared_memory
from moe.experts._triton.rows import RowValidity
from moe.experts._triton.support import config_key, quantize_activation
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, DispatchShape
from moe.presets import load_preset, preset_names
from moe.experts._triton.weights import SCALE_WORD_FORMATS
from moe.quant import QuantFormat, QuantScheme
from moe.quant.scheme import SCHEME_NAMES
from moe.registry import get_experts
from moe.tools.bench import backend_calls, build_weights, make_inputs, time_calls, time_in_turns
from moe.tools.cli_args import comma_separated, int_at_least, one_of
from moe.workspace import WorkspaceManager
from moe.progress import Progress

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# schemes whose weights may take TMA-A tiles: dense, 16-bit (float32's IEEE products gain nothing from TMA)
TMA_A_SCHEMES = ("bf16", "fp16")


# --- the search space --------------------------------------------------------------------------------


def candidate_block_ms(rows_per_expert: float) -> tuple[int, ...]:
    if rows_per_expert <= 8:
        return (16,)
    if rows_per_expert <= 24:
        return (16, 32)
    if rows_per_expert <= 32:  # weight streaming still: small blocks sharing tiles through L2 may win
        return (16, 32, 64)
    if rows_per_expert <= 96:  # or one block per expert: no tile read twice, half its rows padding
        return (16, 32, 64, 128)
    return (64, 128)


def candidate_rows(tokens: int, rows_per_expert: float) -> list[tuple[int, bool]]:
    """(block_m, direct) pairs: direct (unsorted) only where a token's experts rarely repeat."""
    plans = [(bm, False) for bm in candidate_block_ms(rows_per_expert)]
    return plans + [(16, True)] if rows_per_expert <= 1 and tokens <= 64 else plans


def candidate_tiles(block_m: int, wide_output: bool, scheme: str, rows_per_expert: float) -> list[TileConfig]:
    """Tiles for one GEMM; ``wide_output`` is False for the gated first GEMM (two accumulators).

    Small blocks stream weights (memory bound): wide K steps, deep pipelines, and GROUP_M > 1 so
    that an expert's several blocks read each weight tile while it is still in L2. Blocks of 64+ rows
    of a dense 16-bit scheme also try each TMA tile as a TMA-A tile (``tma_a``: A rows gathered into
    sorted order first, then loaded by TMA too), the path that won on the H100 at BLOCK_M 128
    (benchmarks/results/tma_a_nvidia-h100.md).
    """
    weight = QuantScheme.from_name(scheme).weight
    ks = {QuantFormat.FP8_BLOCK: (64, 128), QuantFormat.MXFP4: (64, 128, 256)}.get(weight)
    groups = (1,) if rows_per_expert <= block_m else (1, 8)
    if block_m == 16:
        ns = (64, 128, 256) if wide_output else (32, 64, 128)
        space = itertools.product(ns, ks or (128, 256), (4,), (3, 4, 5), groups)
    elif block_m == 32:
        ns = (64, 128, 256) if wide_output else (64, 128)
        space = itertools.product(ns, ks or (64, 128, 256), (4,), (3, 4), groups)
    else:
        ns = (64, 128, 256) if wide_output else (64, 128)
        groups = (8,) if rows_per_expert >= 256 else (1, 8)
        space = itertools.product(ns, ks or (64, 128), (4, 8), (3, 4), groups)
    tiles = [TileConfig(n, k, g, w, s) for n, k, w, s, g in space]
    # weight tiles by TMA as well, where the weights allow it (not those with scale words: MXFP4, NVFP4,
    # MXFP8) and the box is <= 128 wide
    if weight not in SCALE_WORD_FORMATS:
        tiles += [dataclasses.replace(t, tma=True) for t in tiles if t.block_k <= 128]
    if scheme in TMA_A_SCHEMES and block_m >= 64:  # a gated 256-column tile overflows shared memory
        tiles += [dataclasses.replace(t, tma_a=True) for t in tiles if t.tma and (wide_output or t.block_n < 256)]
    # a 128-row block with 4 warps spills its accumulators on wide tiles
    return [t for t in tiles if not (block_m == 128 and t.num_warps == 4 and t.block_n >= 128)]


def wgmma_candidates(scheme: str, rows_per_expert: float, capability: tuple[int, int]) -> list[LaunchConfig]:
    """Whole-stage configs of the pipelined-wgmma GEMMs (gemm_wgmma.py): fp8_block on SM90, where blocks of
    64+ rows fill. They go straight to the end-to-end round of `tune_bucket`: their GEMM1 includes the gather
    and their GEMM2 reads rows only a wgmma GEMM1 writes, so they pair only with each other. The first two
    were the fastest of session 9's H100 runs (benchmarks/results/fp8_block_wgmma_nvidia-h100.md); the
    others are ``ws`` tiles, the warp-specialized persistent kernel on the same operands (gemm_ws.py), the
    64-row ones two programs per SM (`gemm_ws.fp8_programs_per_sm`), each also with both GEMMs storing their
    tiles by TMA (``tma_store``: 4.5-14% faster at the H200's 128-row buckets, 4-8% at its 64-row ones)."""
    if scheme != "fp8_block" or capability != (9, 0) or rows_per_expert < 32:
        return []

    def config(block_m: int, gemm1_n: int, gemm2_n: int, warps: int, stages: int = 4, ws: bool = False,
               stored: bool = False):
        tile = TileConfig(gemm1_n, 128, 8, warps, stages, tma=True, wgmma=True, ws=ws, tma_store=stored)
        return LaunchConfig(block_m, tile, dataclasses.replace(tile, block_n=gemm2_n))

    # the warp-specialized persistent twins (gemm_ws.py): wgmmas up to 128 columns wide
    ws = [config(128, 64, 128, 8, ws=True), config(128, 64, 128, 8, stages=6, ws=True),
          config(64, 64, 128, 4, ws=True), config(64, 64, 128, 4, stages=3, ws=True),
          config(128, 64, 128, 8, ws=True, stored=True), config(64, 64, 128, 4, ws=True, stored=True),
          config(64, 64, 128, 4, stages=3, ws=True, stored=True)]
    return [config(64, 64, 128, 4), config(128, 64, 128, 8), config(64, 32, 128, 4), config(64, 64, 256, 8),
            config(128, 64, 128, 8, stages=3), *ws]


def fitted_ring(tile: TileConfig, block_m: int, gated: bool, element_size: int, out_size: int | None = None
                ) -> TileConfig:
    """``tile`` with its ring made shallower, down to 2 stages, until it fits shared memory beside its staged output
    (`gemm_ws.fits_shared_memory`); the caller's launch check refuses one that still does not."""
    while tile.num_stages > 2 and not fits_shared_memory(tile, block_m, gated, element_size, out_size):
        tile = dataclasses.replace(tile, num_stages=tile.num_stages - 1)
    return tile


def ws_candidates(scheme: str, rows_per_expert: float, capability: tuple[int, int]) -> list[LaunchConfig]:
    """Whole-stage configs of the warp-specialized persistent GEMMs (gemm_ws.py): bf16 / fp16 on SM90, where
    blocks of 64+ rows fill. Like `wgmma_candidates` they go straight to the end-to-end round of `tune_bucket`
    (both GEMMs on the sorted rows, the gather included). The fastest of session 15's H200 sweeps
    (benchmarks/results/bf16_ws_nvidia-h200.md): 128 x (2 x 128) / 128 x 256 on 8 warps from 256 rows per
    expert, 64-row blocks below. Each comes twice: as it is, and with GEMM2 storing its sorted tile by TMA
    (``tma_store``, session 31: the epilogue runs under the next tile's K steps), on a ring of 3 where 4 and the
    staged tile would not fit in shared memory. The first of the latter comes a third time with GEMM1's loader
    copying x's rows itself (``gather``, session 32: faster only at Qwen3-30B-A3B's M = 16384 on the H200)."""
    if scheme not in TMA_A_SCHEMES or capability != (9, 0) or rows_per_expert < 32:
        return []

    def config(block_m: int, gemm1_n: int, gemm2_n: int, warps: int, stages: int = 4) -> LaunchConfig:
        tile = TileConfig(gemm1_n, 64, 8, warps, stages, tma=True, tma_a=True, ws=True)
        return LaunchConfig(block_m, tile, dataclasses.replace(tile, block_n=gemm2_n))

    def stored(config: LaunchConfig) -> LaunchConfig:  # 128 x 256: a 64 KiB staged tile, a ring of 3
        gemm2 = fitted_ring(dataclasses.replace(config.gemm2, tma_store=True), config.block_m, False, 2)
        return dataclasses.replace(config, gemm2=gemm2)

    if rows_per_expert >= 192:
        plain = [config(128, 128, 256, 8), config(128, 128, 128, 8)]
    else:
        plain = [config(64, 128, 256, 4), config(64, 128, 256, 8), config(128, 128, 256, 8)]
    first = stored(plain[0])
    return plain + [stored(c) for c in plain] + [dataclasses.replace(first, gemm1=dataclasses.replace(
        first.gemm1, gather=True))]


def whole_stage_candidates(scheme: str, rows_per_expert: float, capability: tuple[int, int]) -> list[LaunchConfig]:
    """The configs that go straight to the end-to-end round: `wgmma_candidates` then `ws_candidates`."""
    return wgmma_candidates(scheme, rows_per_expert, capability) + ws_candidates(scheme, rows_per_expert, capability)


def neighbours(config: LaunchConfig, gated: bool, weights, out_size: int) -> list[LaunchConfig]:
    """The configs one step from a whole-stage config of the warp-specialized kernels (both GEMMs ``ws``): either
    GEMM's TMA store on or off, GEMM1's gathering loader on or off (dense tiles), the group size of both, either
    ring one stage deeper or shallower, a dense GEMM2 128 or 256 columns wide, 64 or 128 rows a block (4 or 8
    warps); a ring is made shallower where the move leaves its tile too large for shared memory. Only those that
    can launch on ``weights`` (`TritonWeights`; ``out_size``: bytes of an output element) come back: valid tiles
    whose ring and staged output fit shared memory, and fp8 wgmma tiles whose accumulators fit registers.

    The hand-made candidates (`ws_candidates`, `wgmma_candidates`) fix most of these knobs. Session 34's H200
    sweep of this neighbourhood found the bf16 tables' Qwen3-30B-A3B M = 1024, GPT-OSS-120B 4096 and DeepSeek-slice
    256 configs, 5-8% faster than the tables' configs in its rounds (benchmarks/results/ws_sweep_s34_nvidia-h200.md)."""
    g1, g2 = config.gemm1, config.gemm2
    if not (g1.ws and g2.ws):
        return []
    moves = [{"gemm1": {"tma_store": not g1.tma_store}}, {"gemm2": {"tma_store": not g2.tma_store}}]
    if g1.tma_a:
        moves.append({"gemm1": {"gather": not g1.gather}})
    moves += [{"gemm1": {"group_m": g}, "gemm2": {"group_m": g}} for g in (1, 4, 8, 16) if g != g1.group_m]
    moves += [{gemm: {"num_stages": tile.num_stages + d}} for gemm, tile in (("gemm1", g1), ("gemm2", g2))
              for d in (1, -1)]
    if not g2.wgmma and g2.block_n in (128, 256):
        moves.append({"gemm2": {"block_n": 384 - g2.block_n}})
    rows, warps = (128, 8) if config.block_m == 64 else (64, 4)
    moves.append({"block_m": rows, "gemm1": {"num_warps": warps}, "gemm2": {"num_warps": warps}})

    operands = (("gemm1", g1, weights.w13, gated), ("gemm2", g2, weights.w2, False))

    def tile_for(move: dict, gemm: str, tile: TileConfig, w, tile_gated: bool) -> TileConfig:
        block_m, size = move.get("block_m", config.block_m), w.data.element_size()
        tile = fitted_ring(dataclasses.replace(tile, **move.get(gemm, {})), block_m, tile_gated, size, out_size)
        check_shared_memory(tile, block_m, tile_gated, size, out_size)
        if tile.wgmma:
            check_wgmma_operands(w, tile, tile_gated, block_m)
        return tile

    found = []
    for move in moves:
        try:
            near = LaunchConfig(move.get("block_m", config.block_m), *(tile_for(move, *op) for op in operands),
                                config.direct)
        except MoEConfigError:  # a step off the valid space: a wgmma ring under 3 stages, a tile that would spill
            continue
        if near != config and near not in found:
            found.append(near)
    return found


# --- one shape ---------------------------------------------------------------------------------------


@dataclass
class TuneCase:
    """One layer's prepared weights and the inputs to time with."""
    problem: object
    experts: object
    weights: object
    inputs: list  # (hidden, TopK) pairs

    @property
    def rows_per_expert(self) -> float:
        """Slots per local expert at the inputs' token count, on average."""
        p = self.problem
        return self.inputs[0][0].shape[0] * p.top_k / p.local_num_experts


def make_case(preset, quant: str, tokens: int, weights, device) -> TuneCase:
    problem = preset.problem(quant=quant, max_tokens=tokens)
    experts = TritonExperts(problem)
    return TuneCase(problem, experts, experts.prepare_weights(weights),
                    make_inputs(preset, problem, tokens, 2, device))


def gemm_launches(case: TuneCase, block_m: int, direct: bool, tiles1, tiles2, device) -> tuple[dict, dict, list]:
    """For each tile, the launches of both GEMMs on each input set (workspace per input set), and
    the alignment calls (none when direct)."""
    p, w = case.problem, case.weights
    first, second, aligns = {t: [] for t in tiles1}, {t: [] for t in tiles2}, []
    for hidden, topk in case.inputs:
        tokens = hidden.shape[0]
        slots = tokens * p.top_k
        ws = WorkspaceManager(device).take(
            case.experts.workspace_shapes(DispatchShape(ActivationFormat.STANDARD, tokens)))
        if direct:
            ids = topk.ids.reshape(-1)
            rows1, rows2 = DirectRows(ids, w.expert_map, p.top_k), DirectRows(ids, w.expert_map, 1)
        else:
            args = (topk.ids, w.expert_map, p.local_num_experts, block_m, ws)
            layout = align_block_size(*args)
            aligns.append(lambda args=args: align_block_size(*args))
            rows1, rows2 = SortedRows(layout, slots, p.top_k), SortedRows(layout, slots, 1)
        here = RowValidity.slots_here(topk.ids, w.expert_map)
        act = QuantFormat.NONE if w.weight_only else p.quant.activation  # what the GEMMs read, as in apply
        x, x_scale = quantize_activation(hidden, act, "x", ws, RowValidity())
        inter, y = ws["inter"][:slots], ws["y"][:slots]
        for t in tiles1:
            first[t].append(_tma_a_gemm1(case, x, rows1, ws, t) if t.tma_a and not direct
                            else gemm_launch(x, x_scale, w.w13, inter, rows1, p.activation, block_m, t))
        ws["inter"].normal_()  # a realistic intermediate for the second GEMM's input
        a2, a2_scale = quantize_activation(inter, act, "inter", ws, here)
        for t in tiles2:
            second[t].append(_tma_a_gemm2(case, rows1, ws, t) if t.tma_a and not direct
                             else gemm_launch(a2, a2_scale, w.w2, y, rows2, None, block_m, t))
    return first, second, aligns


def _tma_a_gemm1(case: TuneCase, x: torch.Tensor, rows: SortedRows, ws, tile: TileConfig) -> LaunchSequence:
    """A ``tma_a`` tile's first GEMM as `TritonExperts` runs it (gemm_tma_a.py): the row gather into
    ``y``, whose time counts as the GEMM's, then the GEMM into the sorted intermediate."""
    count = rows.layout.sorted_slots.numel()
    x_sorted, inter_sorted = ws["y"][:count], ws["inter"][:count]
    return LaunchSequence((gather_launch(x, rows.layout, case.problem.top_k, x_sorted),
                           tma_a_gemm_launch(x_sorted, case.weights.w13, inter_sorted, rows.layout, True,
                                             case.problem.activation, tile)))


def _tma_a_gemm2(case: TuneCase, rows: SortedRows, ws, tile: TileConfig):
    """A ``tma_a`` tile's second GEMM: the sorted intermediate to the slots' rows of ``y``."""
    inter_sorted = ws["inter"][:rows.layout.sorted_slots.numel()]
    return tma_a_gemm_launch(inter_sorted, case.weights.w2, ws["y"][:rows.num_slots], rows.layout, False, None, tile)


def distinct_kernels(launch_sets: list[dict]) -> list[tuple]:
    """The compile specs of the distinct kernels among the launches."""
    specs = {}
    for launches in launch_sets:
        for runs in launches.values():
            for spec in runs[0].compile_specs():
                specs[repr(spec[1:])] = spec
    return list(specs.values())


def precompile_all(specs: list[tuple], pool: ProcessPoolExecutor, progress: Progress | None) -> None:
    """Compiles the kernels in the pool's worker processes into Triton's on-disk cache."""
    for _ in pool.map(precompile, specs):
        if progress:
            progress.step("compiling")


def tile_times(launches: dict, progress: Progress | None) -> dict[TileConfig, float]:
    """Microseconds of each tile's launches (CUDA graphs); infinite for a tile that does not run here."""
    times = {}
    for tile, runs in launches.items():
        try:
            times[tile] = time_calls([r.run for r in runs], graphs=True, budget_ms=30.0)
        except Exception as error:  # noqa: BLE001 -- a tile that does not fit this GPU
            times[tile] = float("inf")
            if progress:
                progress.step(f"skip {type(error).__name__}")
        else:
            if progress:
                progress.step(f"{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}: "
                              f"{times[tile]:.1f}us")
    return times


def tile_pairs(times1: dict, times2: dict) -> list[tuple[float, TileConfig, TileConfig]]:
    """``(us1 + us2, gemm1 tile, gemm2 tile)``: the fastest first tile, and the fastest ``tma_a`` one,
    each with the fastest second tile it can feed -- a ``tma_a`` second GEMM reads the sorted
    intermediate that only a ``tma_a`` first GEMM writes (`LaunchConfig` refuses other pairs)."""
    def fastest(times: dict, ok) -> tuple[float, TileConfig] | None:
        return min(((us, t) for t, us in times.items() if ok(t) and us < float("inf")),
                   key=lambda ut: ut[0], default=None)

    pairs = []
    for first in (fastest(times1, lambda t: True), fastest(times1, lambda t: t.tma_a)):
        second = first and fastest(times2, lambda t, feeds_sorted=first[1].tma_a: feeds_sorted or not t.tma_a)
        if second and (first[0] + second[0], first[1], second[1]) not in pairs:
            pairs.append((first[0] + second[0], first[1], second[1]))
    return pairs


def time_configs(case: TuneCase, configs: list[LaunchConfig], rounds: int = 3) -> list[float]:
    """Median microseconds of the whole experts stage (alignment, both GEMMs, combine) under each
    config, timed like ``python -m moe bench``; the configs take turns, ``rounds`` times (`time_in_turns`), so a
    clock drift during the run hits them alike."""
    tokens = case.inputs[0][0].shape[0]
    device = case.inputs[0][0].device

    def timer(config: LaunchConfig):  # captured afresh on each turn: one config's graph allocated at a time
        def timed() -> float:
            only = dataclasses.replace(case.weights, configs=ConfigTable(case.weights.configs.key, ((tokens, config),)))
            calls = backend_calls(TritonExperts, case.problem, None, case.inputs, device,
                                  experts=case.experts, prepared=only)
            return time_calls(calls, graphs=True)
        return timed

    times = time_in_turns({i: timer(config) for i, config in enumerate(configs)}, rounds)
    return [statistics.median(times[i]) for i in range(len(configs))]


MARGIN = 0.01
"""How much faster (a fraction of its time) a config must be than the table's, in the same round, to be timed
against it head to head (`decide`); a smaller win is not taken. The table config's own time moved by 0.03-4.0%
between the two rounds of one process in session 35's 13 buckets on an H200 (GPT-OSS fp8_block M = 4096: 1508.3
and 1568.8 us), so one round's win of 1% says little alone."""

CONFIRM_ROUNDS = 5
"""Turns the round's winner and the table's config take in the head-to-head that must repeat the win. The fastest
of some twenty configs timed once each is often fastest by luck: session 35's `tune --refine` on the H200 found
eight configs 1.1-5.3% faster than the table's in its second round, and in a five-round A/B five of them were
0.4-2.1% slower than the table's at their bucket's own M."""


def beats(us: float, current_us: float, margin: float = MARGIN) -> bool:
    """Whether ``us`` is faster than ``current_us`` by ``margin`` of it or more."""
    return us <= current_us * (1.0 - margin)


def fastest_of_round(pool: list[LaunchConfig], times: list[float], current: LaunchConfig | None,
                     margin: float = MARGIN) -> tuple[LaunchConfig, float]:
    """The round's fastest config and its time, unless the table's ``current`` config (timed in the same round) is
    within ``margin`` of it: then the current one, so a re-tune does not rewrite a table for a clock's wobble."""
    us, config = min(zip(times, pool, strict=True), key=lambda tc: tc[0])
    if current in pool:
        current_us = times[pool.index(current)]
        if not beats(us, current_us, margin):
            return current, current_us
    return config, us


def decide(case: TuneCase, pool: list[LaunchConfig], times: list[float], current: LaunchConfig | None, label: str,
           timer=time_configs, margin: float = MARGIN) -> tuple[LaunchConfig, float]:
    """`fastest_of_round`; where that replaces the table's ``current`` config, the two are timed head to head
    (`CONFIRM_ROUNDS` turns each) and the new one is kept only where it wins again by more than ``margin``."""
    config, us = fastest_of_round(pool, times, current, margin)
    if config == current:
        sys.stderr.write(f"  {label}: no config {margin:.0%} faster than the table's ({us:.1f} us); kept\n")
    if current not in pool or config == current:
        return config, us
    new_us, current_us = timer(case, [config, current], rounds=CONFIRM_ROUNDS)
    confirmed = beats(new_us, current_us, margin)
    sys.stderr.write(f"  {label}: head to head, {CONFIRM_ROUNDS} rounds: {new_us:.1f} against the table's "
                     f"{current_us:.1f} us -> {'replaces it' if confirmed else 'the table config kept'}\n")
    return (config, new_us) if confirmed else (current, current_us)


def refine(case: TuneCase, finals: list[LaunchConfig], times: list[float], current: LaunchConfig | None,
           label: str, keep: int = 2, timer=time_configs, margin: float = MARGIN) -> tuple[LaunchConfig, float]:
    """After the end-to-end round: the `neighbours` of its ``keep`` fastest configs timed end to end beside them and
    the table's ``current`` one, in a round of their own (a config's time from the first round is not compared
    with the second's: the clocks differ between rounds by a few percent). The fastest of that round wins where it
    beats ``current`` by more than ``margin`` and does again head to head (`decide`); where the fastest configs
    have no neighbour, the first round is decided the same way."""
    order = sorted(range(len(finals)), key=times.__getitem__)
    best = [finals[i] for i in order[:keep]]
    p = case.problem
    near = []
    for config in best:
        near += [n for n in neighbours(config, p.activation.is_gated, case.weights, p.dtype.itemsize)
                 if n not in finals and n not in near]
    if not near:
        return decide(case, finals, times, current, label, timer, margin)
    pool = best + near + ([current] if current is not None and current not in best else [])
    pool_times = timer(case, pool)
    sys.stderr.write(f"  {label}: {len(near)} neighbours of the fastest {keep}, end to end "
                     f"{', '.join(f'{t:.1f}' for t in pool_times)} us\n")
    return decide(case, pool, pool_times, current, label, timer, margin)


def tune_bucket(case: TuneCase, scheme: str, pool: ProcessPoolExecutor, device, label: str,
                current: LaunchConfig | None = None, finalists: int = 3) -> tuple[LaunchConfig, float]:
    """The fastest config for this M: each GEMM's tiles timed apart, per candidate BLOCK_M; then the
    ``finalists`` best plans, the `wgmma_candidates`, the `ws_candidates` and the table's ``current`` one timed end to end
    (`time_configs`), which decides with the neighbours of its two fastest, timed in a round of their own
    (`refine`) -- a tile timed alone can rank differently from the whole stage, and a re-tune should never
    replace a config by one that is slower where it counts."""
    p = case.problem
    tokens, rows_per_expert = case.inputs[0][0].shape[0], case.rows_per_expert
    plans = []
    for block_m, direct in candidate_rows(tokens, rows_per_expert):
        tiles1 = candidate_tiles(block_m, not p.activation.is_gated, scheme, rows_per_expert)
        tiles2 = candidate_tiles(block_m, True, scheme, rows_per_expert)
        plans.append(((block_m, direct), *gemm_launches(case, block_m, direct, tiles1, tiles2, device)))
    specs = distinct_kernels([d for _, a, b, _ in plans for d in (a, b)])
    progress = Progress(len(specs) + sum(len(a) + len(b) for _, a, b, _ in plans), label)
    precompile_all(specs, pool, progress)
    ranked = []
    for (block_m, direct), first, second, aligns in plans:
        pairs = tile_pairs(tile_times(first, progress), tile_times(second, progress))
        # the sorted path also pays the alignment: direct has to beat both together
        align_us = time_calls(aligns, graphs=True, budget_ms=20.0) if aligns and pairs else 0.0
        ranked += [(us + align_us, LaunchConfig(block_m, tile1, tile2, direct)) for us, tile1, tile2 in pairs]
    if not ranked:
        raise RuntimeError(f"no candidate config ran for {label}")
    finals = [c for _, c in sorted(ranked, key=lambda uc: uc[0])[:finalists]]
    capability = torch.cuda.get_device_capability(device)
    finals += whole_stage_candidates(scheme, rows_per_expert, capability)
    if current is not None and current not in finals:
        finals.append(current)
    times = time_configs(case, finals)
    sys.stderr.write(f"  {label}: end to end {', '.join(f'{t:.1f}' for t in times)} us\n")
    return refine(case, finals, times, current, label)


def refine_bucket(case: TuneCase, scheme: str, capability: tuple[int, int], label: str, current: LaunchConfig,
                  timer=time_configs) -> tuple[LaunchConfig, float]:
    """``tune --refine``: no tile search. The config a load takes at this M (``current``) and the whole-stage
    candidates (`wgmma_candidates`, `ws_candidates`) timed end to end, then `refine`. Session 34's hand-run of the
    same rounds took 26-66 s a bucket on an H200, compiling included; the full search times every tile of every
    candidate BLOCK_M first."""
    finals = [current] + [c for c in whole_stage_candidates(scheme, case.rows_per_expert, capability) if c != current]
    times = timer(case, finals)
    sys.stderr.write(f"  {label}: end to end {', '.join(f'{t:.1f}' for t in times)} us (the first: the table's)\n")
    return refine(case, finals, times, current, label, timer=timer)


def tune_preset(preset_name: str, quant: str, tokens, out_dir: Path, workers: int, refine_only: bool = False) -> Path:
    device = torch.device("cuda")
    preset = load_preset(preset_name)
    problem = preset.problem(quant=quant, max_tokens=max(tokens))
    weights = build_weights(problem, device)
    key = config_key(problem, "standard", device)
    # buckets tuned before are kept (and the table's decode section, which tuning does not touch): those in out_dir,
    # else the table a load would read
    before = ConfigTable.load(key, out_dir) if (out_dir / key.filename).exists() else ConfigTable.load(key)
    configs = dict(before.configs)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for m in tokens:
            case = make_case(preset, quant, m, weights, device)
            label = f"{preset_name} {quant} M={m}"
            if refine_only:  # from the config a load of this table takes at M: the bucket's, else the nearest one's
                current = ConfigTable(key, tuple(sorted(configs.items()))).lookup(m)
                config, us = refine_bucket(case, quant, torch.cuda.get_device_capability(device), label, current)
            else:
                config, us = tune_bucket(case, quant, pool, device, label, configs.get(m))
            sys.stderr.write(f"  M={m}: {config} ({us:.1f} us for the whole experts stage)\n")
            configs[m] = config
            path = ConfigTable(key, tuple(sorted(configs.items())), before.decode).save(out_dir)
    return path  # saved after every bucket, so a run cut short keeps what it found


# --- command line ------------------------------------------------------------------------------------


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help="comma-separated preset names",
                        type=comma_separated(one_of(preset_names(), "preset"), "mixtral-8x7b"))
    parser.add_argument("--quant", type=comma_separated(one_of(SCHEME_NAMES, "scheme"), "bf16,fp8_block"),
                        default=["bf16"], help="comma-separated schemes (default bf16)")
    parser.add_argument("--tokens", type=comma_separated(int_at_least(1), "256,1024"), default=list(DEFAULT_TOKENS),
                        help="comma-separated token counts M >= 1 to tune (the buckets)")
    parser.add_argument("--out", default=None, help="directory for the config files (default: triton/ in the "
                        "tuning cache, $MOE_CACHE_DIR or ~/.cache/moe, which loads read before the packaged "
                        f"tables; with the cache off, the packaged {CONFIG_DIR})")
    parser.add_argument("--workers", type=int_at_least(1), default=min(16, os.cpu_count() or 1),
                        help="processes compiling kernels in parallel")
    parser.add_argument("--refine", action="store_true",
                        help="no tile search: time each bucket's current config (the one a load takes at that M) "
                             "against the warp-specialized candidates and the fastest two's neighbours, end to end, "
                             f"and keep the fastest where it beats the current one by over {MARGIN:.0%}% again in "
                             f"{CONFIRM_ROUNDS} rounds head to head (about a minute a bucket on an H200)")


def tune_command(args: argparse.Namespace) -> int:
    if args.out is None:
        args.out = str(triton_cache_dir() or CONFIG_DIR)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise MoEConfigError(f"--out {args.out}: exists and is not a folder")
    for preset in args.preset:  # what the Triton experts cannot serve is refused before any compiling
        for quant in args.quant:
            problem = load_preset(preset).problem(quant=quant, max_tokens=max(args.tokens))
            reasons = get_experts("triton").check(problem, None)
            if reasons:
                raise UnsupportedError(f"--preset {preset} --quant {quant}: the Triton experts cannot serve it",
                                       reasons)
    if not torch.cuda.is_available():
        raise UnsupportedError("needs a CUDA GPU, and torch finds none on this machine")
    for preset in args.preset:
        for quant in args.quant:
            path = tune_preset(preset, quant, args.tokens, Path(args.out), args.workers, args.refine)
            print(f"wrote {path}")
    return 0
