"""benchmarks/decode_shape_floor.py on a CPU: under Triton's interpreter each program reads exactly the boxes it claims
in both layouts (its stored value is its twin's sum, to the bit); compiled for sm90 the kernel loads them by TMA and
multiplies them by wgmma; the shapes come from the presets; and without a GPU the script says so."""

from __future__ import annotations

import argparse
import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates the kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import benchmark_script, compiled_in_subprocess  # noqa: E402

SCRIPT = "decode_shape_floor"
SHAPES = {  # N, K, splits
    "whole": (256, 512, 2),  # whole boxes; 4 K steps in splits of 2
    # the last tile's rows run into the up half and past the last row, K's last step is part zero fill; 3 steps in
    # splits of 1, the fourth split has none
    "ragged": (200, 320, 4),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's check")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("layout", ["rows", "blocked"])
def test_each_program_reads_the_boxes_it_claims(layout, gated, shape):
    """Two experts, 128-row tiles: small integers, exact in e4m3 and in the fp32 sums, so any box read twice,
    missed or misplaced changes a program's value."""
    script = benchmark_script(SCRIPT)
    n, k, splits = SHAPES[shape]
    gemm, tile = script.Gemm("gemm", 2, n, k, gated), script.Tile(128, splits, 1, 4)
    weights = torch.randint(-8, 9, (gemm.experts * gemm.rows, k), generator=torch.Generator().manual_seed(0))
    weights = weights.to(torch.float8_e4m3fn)
    act = torch.ones(script.BLOCK_M, script.BLOCK_K).to(torch.float8_e4m3fn)
    buffer = script.weight_boxes(weights, gemm, tile.block_n) if layout == "blocked" else weights
    programs = gemm.experts * gemm.tiles(tile.block_n) * tile.splits
    out = torch.full((programs,), float("nan"))
    blocked = layout == "blocked"
    script.launch(script.descriptor(buffer.flatten(), gemm, tile.block_n, blocked), act, out, gemm, tile, blocked)
    want = script.program_sums(weights, act, gemm, tile)
    assert want.abs().sum() > 0 and torch.equal(out, want), (out, want)


def test_the_blocked_layout_holds_the_weights_bytes_when_boxes_are_whole():
    """Whole boxes: the blocked layout is a permutation of the rows layout's bytes, no padding."""
    script = benchmark_script(SCRIPT)
    gemm = script.Gemm("gemm1", 2, 256, 384, True)
    weights = torch.arange(gemm.nbytes, dtype=torch.int32).view(gemm.experts * gemm.rows, gemm.k)
    boxes = script.weight_boxes(weights, gemm, 128)
    assert gemm.blocked_bytes(128) == gemm.nbytes
    assert torch.equal(boxes.flatten().sort().values, weights.flatten())
    assert torch.equal(boxes[1, 0, 2, 1], weights[gemm.rows + gemm.n: gemm.rows + gemm.n + 128, 256:384])


def test_shapes_come_from_the_preset_and_the_rotation_exceeds_the_l2():
    """Qwen3-30B-A3B at one token hits its k = 8 experts: GEMM1 [8 * 2I, H] gated, GEMM2 [8 * H, I]; its 25 MB GEMM1
    needs nine buffers to pass `MIN_ROTATED_BYTES`."""
    script = benchmark_script(SCRIPT)
    gemm1, gemm2 = script.gemms("qwen3-30b-a3b", torch.device("cpu"))
    assert gemm1 == script.Gemm("gemm1", 8, 768, 2048, True)
    assert gemm2 == script.Gemm("gemm2", 8, 2048, 768, False)
    assert script.rotations(gemm1.nbytes) == 9
    assert script.rotations(gemm1.nbytes) * gemm1.nbytes >= script.MIN_ROTATED_BYTES
    assert script.rotations(10 * script.MIN_ROTATED_BYTES) == 2


def test_the_kernel_compiles_for_sm90_to_tma_loads_and_wgmmas():
    """Compiled for sm90 in a process of its own (TRITON_INTERPRET off), each variant's PTX loads its boxes by TMA
    (``cp.async.bulk.tensor``) and multiplies them by wgmma."""
    found = compiled_in_subprocess("decode_shape_floor", "[['cp.async.bulk.tensor' in p, 'wgmma.mma_async' in p] "
                                   "for p in (s.ptx(g, b) for g in (False, True) for b in (False, True))]")
    assert found == [[True, True]] * 4, found


def test_a_tile_names_its_format():
    script = benchmark_script(SCRIPT)
    assert str(script.Tile.parse("128:4:3:8")) == "128:4:3:8"
    with pytest.raises(argparse.ArgumentTypeError, match="block_n:splits:stages:warps"):
        script.Tile.parse("128:4:2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_the_script_says_so(capsys):
    assert benchmark_script(SCRIPT).main(["--preset", "qwen3-30b-a3b"]) == 1
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1
