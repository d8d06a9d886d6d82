"""ws=True tiles (gemm_ws.py): the dense grouped GEMM as a warp-specialized, persistent Gluon kernel, and the fp8
128-block one (ws on a wgmma tile). Gluon does not run under the CPU interpreter: here the configs' rules, the register split, the errors a CPU (or a quantized
problem) gets, and the kernel compiled for sm90 with the installed Triton (registers, spills, no wgmma
serialized by ptxas). The numbers are checked on the GPU: tests/gpu/test_triton_ws_gpu.py (dense) and
tests/gpu/test_triton_wgmma_gpu.py (fp8).
"""

import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from moe.errors import MoEConfigError  # noqa: E402
from moe.experts._triton.config import ConfigTable, LaunchConfig, TileConfig  # noqa: E402
from moe.experts._triton.gemm_wgmma import check_wgmma_operands  # noqa: E402
from moe.experts._triton.gemm_ws import LOADER_REGS, fp8_programs_per_sm, max_registers  # noqa: E402
from moe.experts._triton.support import config_key  # noqa: E402
from moe.experts._triton.weights import prepare_triton_weights  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from tests.test_triton import make_problem, make_topk, make_weights  # noqa: E402
from tests.test_triton_weight_only import run  # noqa: E402


def ws_tile(block_n=128, num_warps=8, stages=4, **kw) -> TileConfig:
    return TileConfig(block_n, 64, 8, num_warps, stages, tma=True, tma_a=True, ws=True, **kw)


@pytest.mark.parametrize("changes, message", [
    (dict(tma_a=False), r"ws=True tiles are tma_a=True \(dense\) or wgmma=True \(fp8_block\) tiles"),
    (dict(num_warps=2), "num_warps 4 or 8"),
    (dict(block_k=16), "block_k 32, 64 or 128"),
    (dict(num_stages=1), "num_stages >= 2"),
])
def test_ws_tile_rules_name_the_constraint(changes, message):
    fields = {**dict(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, tma=True, tma_a=True, ws=True),
              **changes}
    with pytest.raises(MoEConfigError, match=message):
        TileConfig(**fields)


@pytest.mark.parametrize("changes", [dict(ws=False), dict(tma_a=False, wgmma=True, block_k=128, ws=False)],
                         ids=["dense-not-ws", "fp8-wgmma-not-ws"])
def test_tma_store_is_an_epilogue_of_ws_tiles(changes):
    fields = {**dict(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, tma=True, tma_a=True, ws=True,
                     tma_store=True), **changes}
    with pytest.raises(MoEConfigError, match="tma_store=True is an epilogue of the ws tiles"):
        TileConfig(**fields)
    assert TileConfig(128, 128, 8, 8, 4, tma=True, wgmma=True, ws=True, tma_store=True).tma_store  # fp8 ws: allowed


def test_gather_is_a_loader_of_dense_ws_tiles_on_gemm1():
    dense = TileConfig(128, 64, 8, 8, 4, tma=True, tma_a=True, ws=True)
    with pytest.raises(MoEConfigError, match="gather=True is a loader of the dense ws tiles"):
        dataclasses.replace(dense, ws=False, gather=True)
    with pytest.raises(MoEConfigError, match="gather=True is a loader of the dense ws tiles"):
        TileConfig(128, 128, 8, 8, 4, tma=True, wgmma=True, ws=True, gather=True)
    gather = dataclasses.replace(dense, gather=True)
    assert LaunchConfig(128, gather, dense).gemm1.gather
    with pytest.raises(MoEConfigError, match="gather=True is set on GEMM1 only"):
        LaunchConfig(128, dense, gather)
    with pytest.raises(MoEConfigError, match="gather=True is set on GEMM1 only"):
        LaunchConfig(128, gather, TileConfig(128, 64, 8, 8, 4, tma=True))  # a pointer GEMM2 reads slots' rows


@pytest.mark.parametrize("shape, stride, row_div, message", [
    ((4, 96), None, 8, "K must be a multiple of block_k"),  # 96 columns: one and a half 64-column steps
    ((4, 128), (130, 1), 8, "rows 16-byte multiples apart"),  # rows 260 bytes apart
    ((4, 128), None, None, "given the rows per token"),  # not GEMM1 of the sorted pair
], ids=["k-tail", "row-stride", "no-row-div"])
def test_gather_tile_on_rows_it_cannot_copy_is_refused(shape, stride, row_div, message):
    """Checked before any launch, so CPU tensors serve: a clear error naming the constraint, not a wrong result."""
    from moe.experts._triton.gemm_ws import can_gather, check_gather

    a = torch.zeros(shape, dtype=torch.bfloat16)
    if stride is not None:
        a = torch.zeros(shape[0], stride[0], dtype=torch.bfloat16)[:, :shape[1]]
    tile = TileConfig(128, 64, 8, 8, 4, tma=True, tma_a=True, ws=True, gather=True)
    with pytest.raises(MoEConfigError, match=message):
        check_gather(a, tile, row_div)
    # the layer asks can_gather first and gathers rows it cannot copy with the gather kernel instead
    assert can_gather(a, tile) == (row_div is None)
    check_gather(torch.zeros(4, 128, dtype=torch.bfloat16), tile, 8)  # whole steps, 256-byte rows: accepted


@pytest.mark.parametrize("tile, block_m, gated, fits", [
    (ws_tile(256, stages=3, tma_store=True), 128, False, True),  # GEMM2: 144 KiB ring + 64 KiB tile
    (ws_tile(256, stages=4, tma_store=True), 128, False, False),  # 192 + 64 KiB
    (ws_tile(256, stages=4), 128, False, True),  # the tree's GEMM2 tile: no staged tile
    (ws_tile(128, stages=4, tma_store=True), 128, True, True),  # GEMM1: 192 KiB ring + 32 KiB
    (ws_tile(256, num_warps=4, stages=4, tma_store=True), 64, False, True),  # 64 rows: 160 + 32 KiB
])
def test_ws_shared_memory_check_counts_the_staged_output_tile(tile, block_m, gated, fits):
    from moe.experts._triton.gemm_ws import check_shared_memory

    if fits:
        check_shared_memory(tile, block_m, gated, 2)
    else:
        with pytest.raises(MoEConfigError, match=r"must fit in \d+ bytes of shared memory .* or tma_store=False"):
            check_shared_memory(tile, block_m, gated, 2)


def test_store_descriptor_only_where_tma_can_address_the_output():
    """The sorted output goes out by TMA where its rows are 16-byte multiples apart; elsewhere (an odd hidden size)
    the epilogue stores from registers."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper", reason="needs Triton with Gluon")
    from moe.experts._triton.gemm_ws import store_descriptor

    assert store_descriptor(torch.empty(256, 2048, dtype=torch.bfloat16), 128, 256) is not None
    assert store_descriptor(torch.empty(256, 2052, dtype=torch.bfloat16), 128, 256) is None  # rows 4104 bytes apart


def test_ws_tiles_need_64_row_blocks():
    with pytest.raises(MoEConfigError, match="ws=True tiles take block_m >= 64"):
        LaunchConfig(32, ws_tile(), ws_tile())
    assert LaunchConfig(64, ws_tile(num_warps=4), ws_tile(num_warps=4)).gemm1.ws


def test_ws_tables_round_trip():
    config = LaunchConfig(128, ws_tile(), dataclasses.replace(ws_tile(256), num_stages=3))
    assert LaunchConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("num_warps,programs", [(4, 1), (8, 1), (4, 2)])
def test_register_split_fits_the_register_file(num_warps, programs):
    """maxnreg for every warp (the wgmma warps plus the loader's warpgroup) of each program on an SM fits 64K
    registers, in multiples of 8 (setmaxnreg's unit), and leaves the wgmma warps more than the loader keeps:
    at least the three 64-register accumulator tiles of the fp8 consumer."""
    regs = max_registers(num_warps, programs)
    assert regs % 8 == 0 and programs * regs * 32 * (num_warps + 4) <= 65536
    given_back = (regs - LOADER_REGS) * 4 * 32  # the loader warpgroup's surplus, spread over the wgmma warps
    assert regs + given_back // (32 * num_warps) >= 200


@pytest.mark.parametrize("block_m,num_warps,width,stages,programs", [
    (64, 4, 128, 4, 2),  # 96 KiB rings: two fit in an SM's 228 KiB
    (64, 4, 64, 6, 2),  # GPT-OSS's 32-column GEMM1, a ring of 6: 96 KiB
    (64, 4, 128, 6, 1),  # 144 KiB: one
    (128, 8, 128, 4, 1),  # two warpgroups: one program (their registers fill the SM)
])
def test_fp8_ws_programs_per_sm_follow_the_ring(block_m, num_warps, width, stages, programs):
    tile = TileConfig(width, 128, 8, num_warps, stages, tma=True, wgmma=True, ws=True)
    assert fp8_programs_per_sm(tile, block_m, width) == programs


def test_fp8_ws_tiles_storing_by_tma_count_their_output_tile_in_the_fit():
    """Qwen3's GEMM2 tile (64 x 128, 16 KiB of bf16 output staged for its TMA store) still runs two programs per SM
    on a ring of 4 (2 x 113.25 KiB of 228) or 3; 768 bytes more beside the ring of 4 would leave one."""
    tile = TileConfig(128, 128, 8, 4, 4, tma=True, wgmma=True, ws=True, tma_store=True)
    staged = 64 * 128 * 2
    for stages in (3, 4):
        assert fp8_programs_per_sm(dataclasses.replace(tile, num_stages=stages), 64, 128, staged) == 2
    assert fp8_programs_per_sm(tile, 64, 128, staged + 768) == 2
    assert fp8_programs_per_sm(tile, 64, 128, staged + 776) == 1


def test_ws_config_on_a_cpu_is_a_clear_error():
    """A ws tile where no SM90 GPU is (here, the CPU) raises naming the tile kind and the device."""
    p = make_problem()
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(make_weights(p))
    config = LaunchConfig(64, ws_tile(num_warps=4), ws_tile(num_warps=4))
    prepared = dataclasses.replace(prepared, configs=ConfigTable(prepared.configs.key, ((16, config),)))
    x = torch.randn(16, p.hidden_size, dtype=p.dtype)
    with pytest.raises(MoEConfigError, match="ws=True tiles run on SM90 GPUs .* not on cpu"):
        run(experts, prepared, x, make_topk(16, p))


VARIANTS = [
    # Mixtral / DeepSeek GEMM1: gated, 128 x (2 x 128), 8 warps; GEMM2 128 x 256
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8},
    {"GATED": False, "ACTIVATION": 0, "OUT_SORTED": False, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8},
    # one warpgroup, GPT-OSS-like: swiglu_oai and biases
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "ACTIVATION": 3, "HAS_BIAS": True},
    # two warpgroups side by side along N of a 64-row block, a deeper ring
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "STAGES": 6, "E_PAD": 32},
    # the TMA store epilogue: GEMM2 128 x 256 sorted on a ring of 3, GEMM1 on a ring of 4
    {"GATED": False, "ACTIVATION": 0, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "STAGES": 3,
     "TMA_STORE": True},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "TMA_STORE": True},
    # GEMM1's loader copying x's rows by cp.async (four loader warps): Qwen3 / Mixtral's tile, GPT-OSS's 64-row one
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "TMA_STORE": True, "GATHER": True, "A_ROW_DIV": 8},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "ACTIVATION": 3, "HAS_BIAS": True, "GATHER": True,
     "A_ROW_DIV": 4},
]


FP8_VARIANTS = [
    # DeepSeek / Qwen3 GEMM1: gated, 128 x (2 x 64) on two warpgroups; GEMM2 128 x 128
    {"kernel": "fp8_ws", "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
    {"kernel": "fp8_ws", "GATED": False, "ACTIVATION": 0, "OUT_SORTED": False, "BLOCK_M": 128, "BLOCK_N": 128,
     "num_warps": 8},
    # one warpgroup, GPT-OSS-like (swiglu_oai, biases), a deeper ring: two programs per SM (their registers)
    {"kernel": "fp8_ws", "BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "ACTIVATION": 3, "HAS_BIAS": True,
     "STAGES": 6, "programs": 2},
    # one warpgroup, Qwen3's GEMM2: 64 x 128, two programs per SM
    {"kernel": "fp8_ws", "GATED": False, "ACTIVATION": 0, "OUT_SORTED": False, "BLOCK_M": 64, "BLOCK_N": 128,
     "num_warps": 4, "programs": 2},
    # an ungated (relu2) GEMM1: the epilogue applies its activation too
    {"kernel": "fp8_ws", "GATED": False, "ACTIVATION": 4, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4,
     "programs": 2},
    # GEMM2 storing its sorted tile by TMA: Qwen3's 64 x 128 (two programs per SM, rings of 4 and 3), the DeepSeek
    # slice's 128 x 128
    {"kernel": "fp8_ws", "GATED": False, "ACTIVATION": 0, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4,
     "TMA_STORE": True, "programs": 2},
    {"kernel": "fp8_ws", "GATED": False, "ACTIVATION": 0, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4,
     "TMA_STORE": True, "STAGES": 3, "programs": 2},
    # Qwen3's GEMM1 (gated 64 x (2 x 64)) storing by TMA, two programs per SM
    {"kernel": "fp8_ws", "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "TMA_STORE": True, "programs": 2},
    {"kernel": "fp8_ws", "GATED": False, "ACTIVATION": 0, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8,
     "TMA_STORE": True},
]


def _launch_registers(variant: dict) -> int:
    return max_registers(variant["num_warps"], variant.get("programs", 1))


def _compiled(variant: dict) -> dict:
    """The variant as `gluon_compile` takes it: its launch's maxnreg in place of the programs per SM."""
    return {k: v for k, v in variant.items() if k != "programs"} | {"maxnreg": _launch_registers(variant)}


@pytest.fixture(scope="module")
def compiled_variants():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="needs Triton with Gluon")
    variants = [_compiled({"kernel": "ws", **v}) for v in VARIANTS] + [_compiled(v) for v in FP8_VARIANTS]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "moe.testing.gluon_compile", json.dumps(variants)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {json.dumps(v, sort_keys=True): report[json.dumps(full, sort_keys=True)]
            for v, full in zip(VARIANTS + FP8_VARIANTS, variants)}


@pytest.mark.parametrize("variant", VARIANTS + FP8_VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v))
def test_ws_kernel_compiles_for_sm90_without_spills_or_serialized_wgmmas(compiled_variants, variant):
    report = compiled_variants[json.dumps(variant, sort_keys=True)]
    assert "error" not in report, report.get("error")
    assert report["wgmma"] > 0
    # ptxas serializes every wgmma of a kernel when an in-flight accumulator is copied (its C7514 note): the
    # wgmma of one K step would no longer run under the next step's wait for its buffer
    assert not report["serialized"]
    assert report["spill_bytes"] == 0 and report["registers"] <= _launch_registers(variant)
    # a TMA_STORE tile sends its staged tile out by TMA and waits before it writes the buffer again; others do not
    staged = bool(variant.get("TMA_STORE"))
    assert (report["tma_stores"] > 0, report["store_waits"] > 0) == (staged, staged)
    # a GATHER tile's loader copies A's rows by cp.async and its threads arrive on the ring's barrier when they
    # land; others load A by TMA
    gather = bool(variant.get("GATHER"))
    assert (report["row_copies"] > 0, report["copy_arrivals"] > 0) == (gather, gather)


def test_tuner_tries_ws_tiles_on_sm90_for_16_bit_schemes_where_blocks_fill():
    from moe.tools.tune import ws_candidates

    wide, narrow = ws_candidates("bf16", 256.0, (9, 0)), ws_candidates("fp16", 64.0, (9, 0))
    assert wide and narrow
    for config in wide + narrow:
        assert config.block_m >= 64 and config.gemm1.ws and config.gemm2.ws and config.gemm1.tma_a
    assert {c.block_m for c in narrow} >= {64}
    assert ws_candidates("fp8_block", 256.0, (9, 0)) == []  # fp8 takes the wgmma tiles
    assert ws_candidates("bf16", 256.0, (8, 0)) == []  # no wgmma before Hopper
    assert ws_candidates("bf16", 256.0, (10, 0)) == []  # Blackwell: another MMA
    assert ws_candidates("bf16", 4.0, (9, 0)) == []  # decode: the 64-row blocks would be padding


def test_tuner_tries_each_ws_tile_with_gemm2_storing_by_tma_and_every_one_fits():
    from moe.experts._triton.gemm_ws import check_shared_memory
    from moe.tools.tune import ws_candidates

    for rows in (64.0, 256.0):
        candidates = ws_candidates("bf16", rows, (9, 0))
        plain = [c for c in candidates if not c.gemm2.tma_store]
        stored = [c for c in candidates if c.gemm2.tma_store and not c.gemm1.gather]
        gathered = [c for c in candidates if c.gemm1.gather]
        assert len(stored) == len(plain) > 0 and len(gathered) == 1 and gathered[0].gemm2.tma_store
        for config in candidates:
            check_shared_memory(config.gemm1, config.block_m, True, 2)
            check_shared_memory(config.gemm2, config.block_m, False, 2)


# --- fp8 128-block: ws on a wgmma tile --------------------------------------------------------------------


def fp8_ws_tile(block_n=64, num_warps=8, **kw) -> TileConfig:
    return TileConfig(block_n, 128, 8, num_warps, 4, tma=True, wgmma=True, ws=True, **kw)


def test_fp8_ws_tiles_are_wgmma_tiles_with_64_row_blocks():
    config = LaunchConfig(128, fp8_ws_tile(), fp8_ws_tile(128))
    assert LaunchConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(MoEConfigError, match="ws=True tiles take block_m >= 64"):
        LaunchConfig(32, fp8_ws_tile(num_warps=4), fp8_ws_tile(128, num_warps=4))
    with pytest.raises(MoEConfigError, match="wgmma=True tiles take block_k=128"):
        TileConfig(64, 64, 8, 8, 4, tma=True, wgmma=True, ws=True)


@pytest.fixture(scope="module")
def fp8_weights():
    """Prepared fp8_block weights of a small gated problem (intermediate 256: block_n 64 and 128 divide it)."""
    p = make_problem("fp8_block", "silu", E=4, k=2, H=256, I=256, max_tokens=8)
    table = ConfigTable(config_key(p, "standard", torch.device("cpu")), ())
    return prepare_triton_weights(make_weights(p), None, table)


@pytest.mark.parametrize("block_m, tile, gated, message", [
    (128, fp8_ws_tile(128), True, "at most 128 columns wide"),  # a 256-column gated wgmma
    (128, fp8_ws_tile(256), False, "at most 128 columns wide"),
    (64, fp8_ws_tile(64, num_warps=8), True, "num_warps = block_m / 16"),  # two warpgroups on 64 rows
    (128, fp8_ws_tile(64, num_warps=4), True, "num_warps = block_m / 16"),
])
def test_fp8_ws_tiles_that_would_spill_are_refused_naming_the_constraint(fp8_weights, block_m, tile, gated, message):
    """The sm90 compile of a 256-column ws wgmma spills and serializes its wgmmas (three accumulator tiles per
    thread): refused before launch, with the tile's numbers."""
    w = fp8_weights.w13 if gated else fp8_weights.w2
    with pytest.raises(MoEConfigError, match=message):
        check_wgmma_operands(w, tile, gated, block_m)
    # the same tile without ws is a plain wgmma tile
    check_wgmma_operands(w, dataclasses.replace(tile, ws=False), gated, block_m)


def test_fp8_ws_tiles_within_the_limits_pass_the_check(fp8_weights):
    check_wgmma_operands(fp8_weights.w13, fp8_ws_tile(64), True, 128)
    check_wgmma_operands(fp8_weights.w2, fp8_ws_tile(128), False, 128)
    check_wgmma_operands(fp8_weights.w13, fp8_ws_tile(32, num_warps=4), True, 64)


def test_tuner_tries_fp8_ws_tiles_that_fit_their_registers(fp8_weights):
    from moe.experts._triton.gemm_ws import check_shared_memory
    from moe.tools.tune import wgmma_candidates

    configs = wgmma_candidates("fp8_block", 256.0, (9, 0))
    ws = [c for c in configs if c.gemm1.ws]
    assert ws and all(c.gemm2.ws and c.gemm1.wgmma for c in ws)
    assert any(c.gemm2.tma_store for c in ws) and any(not c.gemm2.tma_store for c in ws)
    for c in ws:  # the launcher's own checks (it raises on a tile that would spill, or not fit)
        check_wgmma_operands(fp8_weights.w13, c.gemm1, True, c.block_m)
        check_wgmma_operands(fp8_weights.w2, c.gemm2, False, c.block_m)
        check_shared_memory(c.gemm1, c.block_m, True, 1, 2)
        check_shared_memory(c.gemm2, c.block_m, False, 1, 2)


# --- the tuner's second end-to-end round: the neighbours of its two fastest ---------------------------------------


@pytest.fixture(scope="module")
def dense_case():
    """A small gated 16-bit problem and its prepared weights, as the tuner's `TuneCase` holds them (no inputs: the
    round's timer is a stand-in here)."""
    from moe.tools.tune import TuneCase

    p = make_problem("fp16", "silu", E=4, k=2, H=256, I=256, max_tokens=8)
    table = ConfigTable(config_key(p, "standard", torch.device("cpu")), ())
    return TuneCase(p, TritonExperts(p), prepare_triton_weights(make_weights(p), None, table), [])


def changed_fields(a: LaunchConfig, b: LaunchConfig) -> set[str]:
    changed = {"block_m"} if a.block_m != b.block_m else set()
    for name in ("gemm1", "gemm2"):
        x, y = getattr(a, name), getattr(b, name)
        changed |= {f"{name}.{f.name}" for f in dataclasses.fields(x) if getattr(x, f.name) != getattr(y, f.name)}
    return changed


def test_neighbours_of_a_dense_ws_config_change_one_knob_and_all_can_launch(dense_case):
    from moe.experts._triton.gemm_ws import check_shared_memory
    from moe.tools.tune import neighbours

    # the H200 table's Qwen3-30B-A3B M = 1024 config (session 34)
    config = LaunchConfig(64, ws_tile(num_warps=4, tma_store=True, gather=True),
                          ws_tile(256, num_warps=4, tma_store=True))
    near = neighbours(config, True, dense_case.weights, 2)
    assert len(near) == len(set(near)) and config not in near
    for n in near:
        check_shared_memory(n.gemm1, n.block_m, True, 2, 2)
        check_shared_memory(n.gemm2, n.block_m, False, 2, 2)
    changes = [changed_fields(config, n) for n in near]
    for one in ({"gemm1.tma_store"}, {"gemm2.tma_store"}, {"gemm1.gather"}, {"gemm1.group_m", "gemm2.group_m"},
                {"gemm1.num_stages"}, {"gemm2.num_stages"}, {"gemm2.block_n"}):
        assert one in changes, one
    swapped = [n for n in near if n.block_m == 128]
    assert len(swapped) == 1 and swapped[0].gemm1.num_warps == swapped[0].gemm2.num_warps == 8
    assert sorted(n.gemm1.group_m for n in near if "gemm1.group_m" in changed_fields(config, n)) == [1, 4, 16]


def test_neighbours_leave_out_rings_that_overflow_shared_memory(dense_case):
    from moe.tools.tune import neighbours

    # 128 rows, GEMM1 gated and storing by TMA: 4 stages fit, 5 do not (an H200 launch refused it: 245760 bytes)
    config = LaunchConfig(128, ws_tile(tma_store=True), ws_tile(256, stages=3, tma_store=True))
    near = neighbours(config, True, dense_case.weights, 2)
    assert near and all(n.gemm1.num_stages <= 4 for n in near)
    assert any(n.gemm1.num_stages == 3 for n in near)


def test_neighbours_of_an_fp8_ws_config_keep_to_tiles_the_wgmma_kernel_takes(fp8_weights):
    from moe.experts._triton.gemm_ws import check_shared_memory
    from moe.tools.tune import neighbours

    config = LaunchConfig(64, dataclasses.replace(fp8_ws_tile(64, num_warps=4), num_stages=3),
                          dataclasses.replace(fp8_ws_tile(128, num_warps=4, tma_store=True), num_stages=3))
    near = neighbours(config, True, fp8_weights, 2)
    assert near and config not in near
    for n in near:
        check_wgmma_operands(fp8_weights.w13, n.gemm1, True, n.block_m)
        check_wgmma_operands(fp8_weights.w2, n.gemm2, False, n.block_m)
        check_shared_memory(n.gemm1, n.block_m, True, 1, 2)
        check_shared_memory(n.gemm2, n.block_m, False, 1, 2)
        assert n.gemm1.num_stages >= 3 and n.gemm2.num_stages >= 3  # the wgmma ring runs num_stages - 2 ahead
        assert not n.gemm1.gather and n.gemm2.block_n == 128  # no dense-only move
    assert [(n.block_m, n.gemm1.num_warps) for n in near if n.block_m != 64] == [(128, 8)]


def test_configs_other_than_ws_have_no_neighbours(dense_case):
    from moe.tools.tune import neighbours

    config = LaunchConfig(64, TileConfig(128, 64, 8, 4, 4, tma=True), TileConfig(256, 64, 8, 4, 4, tma=True))
    assert neighbours(config, True, dense_case.weights, 2) == []


# a table config on the pointer path (weights by TMA): no ws tile, so no neighbours of its own
POINTER_CONFIG = LaunchConfig(64, TileConfig(128, 64, 1, 4, 4, tma=True), TileConfig(256, 64, 1, 4, 4, tma=True))


def with_256_tokens(case):
    """``case`` with one input set of 256 tokens: 128 rows for each of its 4 experts (2 a token)."""
    hidden = torch.randn(256, case.problem.hidden_size).half()
    return dataclasses.replace(case, inputs=[(hidden, make_topk(256, case.problem))])


class StandInTimer:
    """Times each config of a round from a dict (default 100 us), the head-to-head round (the one asked for more
    than one turn) from ``head_to_head`` where given, and records the rounds it was asked for."""

    def __init__(self, times=None, head_to_head=None):
        self.times, self.head_to_head, self.rounds = times or {}, head_to_head, []

    def __call__(self, case, configs, rounds=1):
        self.rounds.append(list(configs))
        times = self.head_to_head if rounds > 1 and self.head_to_head is not None else self.times
        return [times.get(c, 100.0) for c in configs]


def test_refine_times_the_two_fastest_with_their_neighbours_and_the_current_config(dense_case):
    from moe.tools.tune import neighbours, refine

    slow = LaunchConfig(128, ws_tile(), ws_tile(256))
    first = LaunchConfig(64, ws_tile(num_warps=4), ws_tile(256, num_warps=4, tma_store=True))
    second = LaunchConfig(64, ws_tile(num_warps=8), ws_tile(256, num_warps=8))
    current = POINTER_CONFIG
    finals = [slow, first, second, current]
    winner = neighbours(first, True, dense_case.weights, 2)[-1]
    timer = StandInTimer({winner: 90.0})
    config, us = refine(dense_case, finals, [300.0, 100.0, 110.0, 200.0], current, "test", timer=timer)
    assert (config, us) == (winner, 90.0)
    pool, head_to_head = timer.rounds
    assert pool[:2] == [first, second] and pool[-1] == current and slow not in pool
    assert winner in pool and not any(c in finals for c in pool[2:-1])
    assert head_to_head == [winner, current]


def test_refine_keeps_the_current_config_where_the_head_to_head_does_not_repeat_the_win(dense_case):
    """Round two's fastest (90 us against the table's 100) is timed against the table's config again, over
    CONFIRM_ROUNDS turns; at 99.5 against 100 there it is not faster by the margin, and the table's config stays."""
    from moe.tools.tune import CONFIRM_ROUNDS, neighbours, refine

    first = LaunchConfig(64, ws_tile(num_warps=4), ws_tile(256, num_warps=4))
    current = POINTER_CONFIG
    winner = neighbours(first, True, dense_case.weights, 2)[0]
    timer = StandInTimer({winner: 90.0}, head_to_head={winner: 99.5, current: 100.0})
    assert CONFIRM_ROUNDS > 1
    assert refine(dense_case, [first, current], [95.0, 120.0], current, "test", timer=timer) == (current, 100.0)
    assert timer.rounds[-1] == [winner, current]


def test_refine_keeps_the_current_config_where_its_second_round_is_fastest(dense_case):
    from moe.tools.tune import refine

    first = LaunchConfig(64, ws_tile(num_warps=4), ws_tile(256, num_warps=4))
    current = POINTER_CONFIG
    timer = StandInTimer({current: 50.0})
    assert refine(dense_case, [first, current], [100.0, 120.0], current, "test", timer=timer) == (current, 50.0)


@pytest.mark.parametrize("winner_us, kept", [(99.5, True), (99.2, True), (98.9, False)])
def test_refine_replaces_the_current_config_only_by_one_more_than_the_margin_faster(dense_case, winner_us, kept):
    """The table's config timed at 100 us in the second round: a neighbour 0.5% or 0.8% faster leaves it in place
    (the clock moves that much between rounds), one 1.1% faster replaces it."""
    from moe.tools.tune import MARGIN, neighbours, refine

    assert MARGIN == 0.01
    first = LaunchConfig(64, ws_tile(num_warps=4), ws_tile(256, num_warps=4))
    current = POINTER_CONFIG
    winner = neighbours(first, True, dense_case.weights, 2)[0]
    timer = StandInTimer({first: 101.0, current: 100.0, winner: winner_us})
    config, us = refine(dense_case, [first, current], [90.0, 120.0], current, "test", timer=timer)
    assert (config, us) == ((current, 100.0) if kept else (winner, winner_us))


def test_refine_without_neighbours_keeps_the_current_config_within_the_margin(dense_case):
    from moe.tools.tune import refine

    plain = [LaunchConfig(64, TileConfig(128, 64, 8, 4, 4, tma=True), TileConfig(256, 64, 8, 4, n, tma=True))
             for n in (3, 4)]
    assert refine(dense_case, plain, [100.0, 99.5], plain[0], "test", timer=StandInTimer()) == (plain[0], 100.0)
    timer = StandInTimer({plain[0]: 100.0, plain[1]: 98.0})
    assert refine(dense_case, plain, [100.0, 98.0], plain[0], "test", timer=timer) == (plain[1], 98.0)
    assert timer.rounds == [plain[::-1]]  # no second round, only the head to head


def test_refine_without_neighbours_takes_the_first_rounds_fastest_without_a_second_round(dense_case):
    from moe.tools.tune import refine

    plain = [LaunchConfig(64, TileConfig(128, 64, 8, 4, 4, tma=True), TileConfig(256, 64, 8, 4, n, tma=True))
             for n in (3, 4)]
    timer = StandInTimer()
    assert refine(dense_case, plain, [120.0, 110.0], None, "test", timer=timer) == (plain[1], 110.0)
    assert timer.rounds == []


def test_tune_refine_starts_from_the_current_config_then_times_its_neighbourhood(dense_case):
    """``tune --refine``: round one is the current config and the ws candidates, round two the fastest two with
    their neighbours and the current config; the second round decides."""
    from moe.tools.tune import neighbours, refine_bucket, ws_candidates

    case = with_256_tokens(dense_case)
    current = POINTER_CONFIG
    candidates = ws_candidates("fp16", 128.0, (9, 0))
    fastest = candidates[-1]
    winner = neighbours(fastest, True, case.weights, 2)[0]
    timer = StandInTimer({fastest: 80.0, candidates[0]: 90.0, winner: 70.0})
    assert refine_bucket(case, "fp16", (9, 0), "test", current, timer=timer) == (winner, 70.0)
    first, second, head_to_head = timer.rounds
    assert first == [current, *candidates]
    assert second[:2] == [fastest, candidates[0]] and second[-1] == current and winner in second
    assert head_to_head == [winner, current]


def test_tune_refine_on_a_gpu_without_ws_tiles_keeps_the_current_config(dense_case):
    from moe.tools.tune import refine_bucket

    case = with_256_tokens(dense_case)
    current = POINTER_CONFIG
    timer = StandInTimer({current: 50.0})
    assert refine_bucket(case, "fp16", (8, 0), "test", current, timer=timer) == (current, 50.0)  # an A100
    assert timer.rounds == [[current]]
