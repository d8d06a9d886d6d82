"""Small ``@triton.jit`` helpers used instead of ``triton.language``'s own jit'd ones.

``tl.sum``, ``tl.max``, ``tl.min``, ``tl.cumsum``, ``tl.cdiv``, ``tl.sigmoid`` and ``tl.zeros`` are themselves
``@triton.jit`` functions, decorated when ``triton.language`` is first imported. If that import came
before ``TRITON_INTERPRET=1`` was set (a test suite importing torch first), the CPU interpreter cannot
call them. These twins are decorated with the kernels, so they follow the kernels' mode; on a GPU
they compile to the same code (a reduction or scan with the same combine function).
"""

import triton
import triton.language as tl


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
