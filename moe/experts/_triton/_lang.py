"""Small ``@triton.jit`` helpers used instead of ``triton.language``'s own jit'd ones.

``tl.sum``, ``tl.max``, ``tl.min``, ``tl.cumsum``, ``tl.cdiv``, ``tl.sigmoid`` and ``tl.zeros`` are themselves
``@triton.jit`` functions, decorated when ``triton.language`` is first imported. If that import came
before ``TRITON_INTERPRET=1`` was set (a test suite importing torch first), the CPU interpreter cannot
call them. These twins are decorated with the kernels, so they follow the kernels' mode; on a GPU
they compile to the same code (a reduction or scan with the same combine function).

The grid dependency control of a programmatic dependent launch (`gdc_wait`, `gdc_launch_dependents`) and the host's
test for it (`pdl_supported`) live here too, for the decode GEMMs and the routing kernel alike.
"""

import torch
import triton
import triton.language as tl

try:  # grid dependency control (a programmatic dependent launch): Triton 3.4+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_PDL = True
except ImportError:  # `pdl_supported` is False then, and no kernel asks for them
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` may take part in a programmatic dependent launch: a CUDA GPU of SM90 or newer
    and Triton 3.4+ (the routing kernel and the decode GEMMs ask this before they set their PDL constexprs)."""
    return HAS_PDL and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


# The reductions and the scan combine with triton.language's own combine functions: the CPU interpreter
# recognizes those (by identity: they are compared, never called) and reduces or scans with numpy, where a
# combine function of ours is called element by element in Python (85% of an MXFP4 decode test's time; the
# scan, 2.6% of the fp8 decode tests'). On a GPU the code is the same either way.
@triton.jit
def sum_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def max_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def min_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def cumsum_(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def cdiv_(a, b):
    return (a + b - 1) // b


@triton.jit
def sigmoid_(x):
    return 1.0 / (1.0 + tl.exp(-x))
