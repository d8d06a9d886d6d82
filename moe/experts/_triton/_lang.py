"""Small ``@triton.jit`` helpers used instead of ``triton.language``'s own jit'd ones.

``tl.sum``, ``tl.max``, ``tl.min``, ``tl.cumsum``, ``tl.cdiv``, ``tl.sigmoid`` and ``tl.zeros`` are themselves
``@triton.jit`` functions, decorated when ``triton.language`` is first imported. If that import came
before ``TRITON_INTERPRET=1`` was set (a test suite importing torch first), the CPU interpreter cannot
call them. These twins are decorated with the kernels, so they follow the kernels' mode; on a GPU
they compile to the same code (a reduction or scan with the same combine function).
"""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _smaller(a, b):
    return tl.minimum(a, b)


@triton.jit
def sum_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _add)


@triton.jit
def max_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _larger)


@triton.jit
def min_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _smaller)


@triton.jit
def cumsum_(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, _add)


@triton.jit
def cdiv_(a, b):
    return (a + b - 1) // b


@triton.jit
def sigmoid_(x):
    return 1.0 / (1.0 + tl.exp(-x))
