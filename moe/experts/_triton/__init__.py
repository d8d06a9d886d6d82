"""Triton kernels behind the ``triton`` and ``triton_batched`` experts (private: no stable API).

Layout, one concept per module; each launcher module holds the launcher and its torch twin, the
``_``-prefixed sibling holds the ``@triton.jit`` code::

    align.py      / _align.py       sort the (token, slot) pairs by expert and pad each expert to BLOCK_M
    gemm.py       / _gemm.py        the grouped GEMMs: w13 with the activation fused in, then w2
    gemm_tma_a.py / _gemm_tma_a.py  tma_a=True tiles: A rows gathered in sorted order, A and W by TMA
    gemm_wgmma.py / _gemm_wgmma.py  wgmma=True tiles: fp8_block on SM90, a Gluon kernel with a pipelined wgmma
    gemm_ws.py    / _gemm_ws.py     ws=True tiles: tma_a tiles on SM90 whose GEMM is a warp-specialized,
                                    persistent Gluon kernel (bf16/fp16)
    rows.py       / _rows.py        per-row helpers: fp8 activation quantization, weighted sum over k
    _lang.py                        jit'd twins of triton.language helpers (interpreter-safe)
    config.py                       launch configurations: data files per shape and device, defaults
    weights.py                      ``TritonWeights``: canonical weights converted once for the kernels
    support.py                      what the two experts share: capability data, checks, config keys

The kernels run on CUDA GPUs (SM80+; fp8 needs SM89+) and, slowly, on CPU tensors under
``TRITON_INTERPRET=1`` (tests use float16/float32 there: the interpreter gets bfloat16 wrong).

The launcher modules import no Triton at module load (``import moe`` must work without it): the
jit modules load at the first launch, and the launchers' integer helpers are the two below.
"""

from moe.registry import LibrarySupport, register_library

# The Triton release a simulated GPU platform reports (Platform.preset); the explanation prints it,
# no check reads it. Which kernels run is decided by the platform's device, not by this version.
register_library(LibrarySupport("triton", assumed_version="3.6.0"))


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (``triton.cdiv``, without importing triton)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1), as ``triton.next_power_of_2``."""
    return 1 << max(n - 1, 0).bit_length()


def kernels(name: str):
    """The ``@triton.jit`` module ``_<name>`` ("align", "gemm", "rows"), imported on first use.

    ``triton.jit`` decides when a function is decorated whether it will run compiled or in the
    interpreter (TRITON_INTERPRET), so the kernel modules load at the first launch, not with `moe`:
    a CPU test can turn the interpreter on even after something imported `moe.experts`.
    """
    import importlib

    return importlib.import_module(f"moe.experts._triton._{name}")
