"""benchmarks/l2_bandwidth.py's kernel on a CPU (Triton's interpreter): every program XORs the blocks it is given,
in the grid-strided order that cycles through the buffer, so the bytes the bandwidth counts are bytes it read; and
the script refuses to run without a GPU, saying so."""

from __future__ import annotations

import functools
import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates the kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import benchmark_script  # noqa: E402


def _script():
    return benchmark_script("l2_bandwidth")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's check")
def test_each_program_reads_its_grid_strided_blocks():
    script = _script()
    block, blocks, grid, iters = script.BLOCK, 5, 3, 7
    src = torch.randint(0, 2**30, (blocks * block,), dtype=torch.int32)
    out = torch.empty(grid * block, dtype=torch.int32)
    script.read_kernel[(grid,)](src, out, blocks, ITERS=iters, BLOCK=block)
    for pid in range(grid):
        read = [src.view(blocks, block)[(pid + i * grid) % blocks] for i in range(iters)]
        assert torch.equal(out.view(grid, block)[pid], functools.reduce(torch.bitwise_xor, read))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_the_script_says_so(capsys):
    assert _script().main(["--sizes-mb", "8"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
