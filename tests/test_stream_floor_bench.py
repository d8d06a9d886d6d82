"""benchmarks/stream_floor.py on a CPU (Triton's interpreter): each program XORs exactly its contiguous run of
blocks (the last program's run cut at the end), so the time it reports is for the bytes it claims; the byte counts
split the bench's roofline between the GEMMs by their weight shapes; and without a GPU the script says so."""

from __future__ import annotations

import functools
import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates the kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import benchmark_script, compiled_in_subprocess  # noqa: E402

SCRIPT = "stream_floor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's check")
def test_each_program_reads_its_contiguous_blocks():
    script = benchmark_script(SCRIPT)
    block, n_blocks = script.BLOCK, 7
    src = torch.randint(0, 2**30, (n_blocks * block,), dtype=torch.int32)
    out = torch.full((3 * block,), -1, dtype=torch.int32)
    script.launch(src, out, programs=3)  # 7 blocks on 3 programs: runs of 3, 3 and 1
    runs = [range(0, 3), range(3, 6), range(6, 7)]
    for pid, run in enumerate(runs):
        want = functools.reduce(torch.bitwise_xor, [src.view(n_blocks, block)[b] for b in run])
        assert torch.equal(out.view(3, block)[pid], want), pid


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's check of the byte counts")
def test_byte_counts_split_the_bench_roofline_by_weight_shape():
    from moe.platform import Platform
    from moe.presets import load_preset

    platform = Platform.detect("cpu")
    problem = load_preset("qwen3-30b-a3b").problem(quant="fp8_block", max_tokens=1)
    counts = benchmark_script(SCRIPT).byte_counts("qwen3-30b-a3b", "fp8_block", platform, torch.device("cpu"))
    bytes1, bytes2, act_bytes, roofline_us = counts
    assert bytes1 / bytes2 == pytest.approx(problem.w13_rows / problem.intermediate_size)
    assert roofline_us == pytest.approx(1e6 * (bytes1 + bytes2 + act_bytes) / platform.memory_bandwidth)


def test_the_tma_kernel_compiles_for_sm90_with_a_ring_of_bulk_loads():
    """The ``*-tma`` modes' Gluon kernel (Gluon does not run in the interpreter): compiled for sm90 in a process of its
    own, its PTX issues TMA tensor loads (the ring's first `TMA_STAGES` unrolled, then one per block in the loop) and
    waits on their mbarriers."""
    pytest.importorskip("triton.experimental.gluon")
    loads, waits, stages = compiled_in_subprocess(
        "stream_floor", "[(p := s.tma_ptx()).count('cp.async.bulk.tensor'), 'mbarrier.try_wait' in p, s.TMA_STAGES]")
    assert loads == stages + 1 and waits


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_the_script_says_so(capsys):
    assert benchmark_script(SCRIPT).main(["--preset", "qwen3-30b-a3b"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
