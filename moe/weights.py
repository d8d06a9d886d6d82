"""`ExpertWeights`: the expert weights of one MoE layer in the canonical layout.

For E experts on this rank, hidden size H and intermediate size I::

    w13  [E, R, H]  first GEMM (h = x @ w13[e].T). R = 2I rows [gate; up] for gated activations
                    (rows 0..I-1 gate, rows I..2I-1 up); R = I for non-gated ones (relu2)
    w2   [E, H, I]  second GEMM (y = act(h) @ w2[e].T)
    b13  [E, R]     optional float32 bias of the first GEMM, rows ordered like w13
    b2   [E, H]     optional float32 bias of the second GEMM

``w13`` and ``w2`` are `QuantizedTensor` s of one shared `QuantFormat`. Packed fp4 formats (mxfp4,
nvfp4) halve the last dimension of ``data`` (two e2m1 codes per byte, low nibble = even element), so
``w13.data`` is ``[E, R, H/2]`` and ``w2.data`` ``[E, H, I/2]``; the properties report unpacked sizes.
Loaders (`moe.loaders`) turn checkpoint layouts into this one; each Experts class converts it once,
in ``prepare_weights``, into what its kernel wants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe.errors import MoEConfigError
from moe.quant import QuantFormat, QuantizedTensor, QuantScheme, dequantize, quantize
from moe.quant.fp8 import FP8_BLOCK_SHAPE
from moe.quant.mx import MX_BLOCK
from moe.quant.nvfp4 import NVFP4_BLOCK
from moe.quant.scheme import SCHEME_NAMES, UNQUANTIZED

if TYPE_CHECKING:
    from moe.problem import MoEProblem

DENSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what unquantized weights may be


@dataclass(frozen=True)
class ExpertWeights:
    """Expert weights in the canonical layout (see the module docstring).

    Worked example: Mixtral-like experts, E=8, H=4096, I=14336, silu (gated), bf16::

        >>> w = ExpertWeights.from_dense(torch.randn(8, 2 * 14336, 4096), torch.randn(8, 4096, 14336),
        ...                              dtype=torch.bfloat16)                       # doctest: +SKIP
        >>> w.num_experts, w.w13_rows, w.hidden_size, w.intermediate_size   # doctest: +SKIP
        (8, 28672, 4096, 14336)

    Expert e's gate rows are ``w13.data[e, :I]`` and its up rows ``w13.data[e, I:]``. Stored as
    mxfp4 (``quant="mxfp4"``), ``w13.data`` would be uint8 ``[8, 28672, 2048]`` with e8m0 scales
    ``[8, 28672, 128]``, and ``w2.data`` uint8 ``[8, 4096, 7168]`` with scales ``[8, 4096, 448]``.
    """

    w13: QuantizedTensor  # [E, R, H] (packed fp4: [E, R, H/2]); R = 2I [gate; up] or I
    w2: QuantizedTensor  # [E, H, I] (packed fp4: [E, H, I/2])
    b13: torch.Tensor | None = None  # [E, R] float32, or None
    b2: torch.Tensor | None = None  # [E, H] float32, or None

    def __post_init__(self):
        for name in ("w13", "w2"):
            q = getattr(self, name)
            if not isinstance(q, QuantizedTensor):
                raise MoEConfigError(
                    f"{name}: expected a QuantizedTensor (got {type(q).__name__}); "
                    "build dense weights with ExpertWeights.from_dense"
                )
            if q.role != "weight" or q.data.dim() != 3:
                raise MoEConfigError(
                    f"{name}: must be a 3-D [E, N, K] weight "
                    f"(got role {q.role!r}, shape {tuple(q.data.shape)})"
                )
            if q.fmt is QuantFormat.NONE and q.data.dtype not in DENSE_DTYPES:
                raise MoEConfigError(
                    f"{name}: unquantized data must be one of {DENSE_DTYPES} (got {q.data.dtype})"
                )
        if self.w13.fmt != self.w2.fmt:
            raise MoEConfigError(
                f"w13 and w2 must share one format (got w13 {self.w13.fmt}, w2 {self.w2.fmt})"
            )
        for name in ("b13", "b2"):
            bias = getattr(self, name)
            if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32):
                got = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
                raise MoEConfigError(f"{name}: must be a float32 tensor or None (got {got})")
        check_shapes(tuple(self.w13.shape), tuple(self.w2.shape), self.b13, self.b2)

    @classmethod
    def from_dense(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        *,
        quant: "str | QuantScheme | QuantFormat" = QuantFormat.NONE,
        dtype: torch.dtype | None = None,
    ) -> "ExpertWeights":
        """Stores dense float tensors in the canonical layout in the scheme's weight format.

        ``quant`` is a scheme name ("bf16", "fp8", "mxfp4", ...), a `QuantScheme` (its weight format
        is used) or a `QuantFormat`. ``dtype`` casts the weights first: for `QuantFormat.NONE` it is
        the storage dtype (default: the tensors' own; "bf16"/"fp16"/"fp32" imply it), for quantized
        formats the precision the values are rounded to before quantizing. Biases become float32.
        Raises `MoEConfigError` for wrong ranks, shapes or dtypes and for NaN/inf anywhere.
        """
        fmt, dtype = resolve_quant(quant, dtype)
        for name, tensor, dims in (("w13", w13, 3), ("w2", w2, 3), ("b13", b13, 2), ("b2", b2, 2)):
            if tensor is not None:
                check_dense(name, tensor, dims)
        check_shapes(tuple(w13.shape), tuple(w2.shape), b13, b2)
        for name, size in (("hidden_size H", w2.shape[1]), ("intermediate_size I", w2.shape[2])):
            if size % fmt.k_multiple:
                raise MoEConfigError(
                    f"{name} must be a multiple of {fmt.k_multiple} to store the weights as {fmt} "
                    f"(got {size}); pad the weights or choose another format"
                )
        if dtype is not None:
            w13, w2 = w13.to(dtype), w2.to(dtype)
        bias = [None if b is None else b.to(torch.float32).contiguous() for b in (b13, b2)]
        return cls(_store(w13, fmt), _store(w2, fmt), *bias)

    @property
    def num_experts(self) -> int:
        return self.w13.data.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.data.shape[1]

    @property
    def w13_rows(self) -> int:
        return self.w13.data.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def weight_format(self) -> QuantFormat:
        return self.w13.fmt

    @property
    def device(self) -> torch.device:
        return self.w13.data.device

    @property
    def has_bias(self) -> bool:
        return self.b13 is not None or self.b2 is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``(w13 [E, R, H], w2 [E, H, I])`` in ``dtype``."""
        return dequantize(self.w13, dtype), dequantize(self.w2, dtype)

    def validate(self, problem: "MoEProblem") -> None:
        """Raises `MoEConfigError` listing every way these weights do not fit ``problem``."""
        reasons = _size_mismatches(self, problem) + _storage_mismatches(self, problem)
        if reasons:
            raise MoEConfigError(
                f"ExpertWeights do not match the problem ({problem.sizes}, activation {problem.activation}, "
                f"quant {problem.quant_name}):\n" + "\n".join(f"  - {r}" for r in reasons)
            )

    def to(self, device: "torch.device | str") -> "ExpertWeights":
        """The same weights on ``device``."""
        return self.map_tensors(lambda t: t.to(device))

    def select_experts(self, expert_ids: Sequence[int]) -> "ExpertWeights":
        """The experts ``expert_ids`` (local indices, in that order, no repeats) as new weights."""
        ids = list(expert_ids)
        experts = self.num_experts
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < experts]
        if bad:
            raise MoEConfigError(
                f"expert_ids: every id must be an int in [0, {self.num_experts}) (got {bad[:8]})"
            )
        if len(set(ids)) != len(ids):
            raise MoEConfigError(f"expert_ids: each expert may be selected once (got {ids})")
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        # Every tensor of a weight starts with the expert dimension, scales included.
        return self.map_tensors(lambda t: t.index_select(0, index))

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "ExpertWeights":
        """New weights with ``fn`` applied to every tensor present (data, scales, global scales, biases)."""
        def on(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        def quantized(q: QuantizedTensor) -> QuantizedTensor:
            return dataclasses.replace(
                q, data=fn(q.data), scale=on(q.scale), global_scale=on(q.global_scale)
            )

        return ExpertWeights(quantized(self.w13), quantized(self.w2), on(self.b13), on(self.b2))


def resolve_quant(
    quant: "str | QuantScheme | QuantFormat", dtype: torch.dtype | None
) -> tuple[QuantFormat, torch.dtype | None]:
    """The weight format that ``quant`` names, and the dtype (a dtype name like "bf16" implies one)."""
    if dtype is not None and dtype not in DENSE_DTYPES:
        raise MoEConfigError(f"dtype must be one of {DENSE_DTYPES} (got {dtype})")
    if isinstance(quant, QuantFormat):
        return quant, dtype
    if isinstance(quant, QuantScheme):
        return quant.weight, dtype
    if isinstance(quant, str) and quant in UNQUANTIZED:
        if dtype is not None and dtype != UNQUANTIZED[quant]:
            raise MoEConfigError(
                f"quant={quant!r} stores weights in {UNQUANTIZED[quant]} but dtype={dtype}; "
                "pass one of them, or quant='unquantized' with the dtype"
            )
        return QuantFormat.NONE, UNQUANTIZED[quant]
    if isinstance(quant, str) and quant in SCHEME_NAMES:
        return QuantScheme.from_name(quant).weight, dtype
    if isinstance(quant, str) and quant in {f.value for f in QuantFormat}:
        return QuantFormat(quant), dtype
    raise MoEConfigError(
        f"quant: {quant!r} is neither a scheme name ({', '.join(SCHEME_NAMES)}), "
        "a QuantScheme nor a QuantFormat"
    )


def check_dense(name: str, tensor: torch.Tensor, dims: int, *, finite: bool = True) -> None:
    """Raises `MoEConfigError` unless ``tensor`` is a fp32/fp16/bf16 tensor of ``dims`` dims with values
    (not on the meta device), finite unless ``finite=False``."""
    if not isinstance(tensor, torch.Tensor):
        raise MoEConfigError(f"{name}: expected a torch.Tensor (got {type(tensor).__name__})")
    if tensor.dtype not in DENSE_DTYPES:
        raise MoEConfigError(f"{name}: dtype must be one of {DENSE_DTYPES} (got {tensor.dtype})")
    if tensor.dim() != dims:
        raise MoEConfigError(f"{name}: must be {dims}-D (got shape {tuple(tensor.shape)})")
    if tensor.device.type == "meta":
        raise MoEConfigError(f"{name}: a meta tensor {tuple(tensor.shape)} holds no values; load the real weights")
    if finite:
        check_finite(name, tensor)


def expected_dense_shapes(problem: "MoEProblem", experts: int | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dims, shape)}`` of dense ``w13``, ``w2``, ``b13``, ``b2`` for ``problem`` with ``experts``
    experts (default: all E), e.g. ``"w13": ("[E, 2I, H] rows [gate; up]", (8, 28672, 4096))``."""
    p = problem
    experts = p.num_experts if experts is None else experts
    rows = "[E, 2I, H] rows [gate; up]" if p.activation.is_gated else f"[E, I, H] ({p.activation} is not gated)"
    return {
        "w13": (rows, (experts, p.w13_rows, p.hidden_size)),
        "w2": ("[E, H, I]", (experts, p.hidden_size, p.intermediate_size)),
        "b13": ("[E, 2I]" if p.activation.is_gated else "[E, I]", (experts, p.w13_rows)),
        "b2": ("[E, H]", (experts, p.hidden_size)),
    }


def check_dense_for(problem: "MoEProblem", **tensors: torch.Tensor | None) -> None:
    """Raises `MoEConfigError` naming the first of ``w13``, ``w2``, ``b13``, ``b2`` that is not a dense
    float tensor of the shape a layer of ``problem`` expects, quoting its sizes. E may be the problem's
    num_experts or, under expert parallelism, this rank's count. NaN is `from_dense`'s to find."""
    p = problem
    layer = f"this layer ({p.sizes}, activation {p.activation})"
    if p.parallel.enabled:
        layer += f"; E may also be this rank's {p.local_num_experts}"
    for name, (dims, shape) in expected_dense_shapes(p).items():
        tensor, is_bias = tensors.get(name), name.startswith("b")
        if tensor is None and (p.has_bias or not is_bias):
            raise MoEConfigError(f"{name}: missing; {layer} needs {dims} (has_bias={p.has_bias})")
        if tensor is not None and is_bias and not p.has_bias:
            raise MoEConfigError(f"{name}: given, but the layer was built with has_bias=False; build it with has_bias=True")
        if tensor is None:
            continue
        check_dense(name, tensor, len(shape), finite=False)
        got = tuple(tensor.shape)
        if got[1:] != shape[1:] or got[0] not in (p.num_experts, p.local_num_experts):
            flipped = len(got) == 3 and got[0] == shape[0] and got[1:] == shape[:0:-1]
            hint = f"; it looks transposed: pass {name}.transpose(1, 2)" if flipped else ""
            raise MoEConfigError(f"{name}: expected shape {dims} = {list(shape)} for {layer} (got {list(got)}){hint}")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raises `MoEConfigError` naming ``name`` if ``tensor`` holds NaN or inf."""
    if not bool(torch.isfinite(tensor).all()):
        what = "NaN" if bool(torch.isnan(tensor).any()) else "inf"
        raise MoEConfigError(f"{name} contains {what} at load; every weight must be finite")


def check_shapes(
    w13: tuple[int, ...], w2: tuple[int, ...], b13: torch.Tensor | None, b2: torch.Tensor | None
) -> None:
    """Checks the unpacked shapes ``w13 [E, R, H]``, ``w2 [E, H, I]`` (R = I or 2I) and the biases."""
    experts, rows, hidden = w13
    if w2[0] != experts or w2[1] != hidden:
        raise MoEConfigError(_transposed(w13, w2) or (
            f"w2: expected shape [E={experts}, H={hidden}, I] to match w13 [E, R, H] = {list(w13)} "
            f"(got {list(w2)})"
        ))
    inter = w2[2]
    if min(hidden, inter) < 1:
        raise MoEConfigError(f"w13 {list(w13)} and w2 {list(w2)}: H and I must be >= 1 (got H={hidden}, I={inter})")
    if rows not in (inter, 2 * inter):
        raise MoEConfigError(
            f"w13: rows R must be 2I={2 * inter} ([gate; up], gated) or I={inter} (non-gated), "
            f"I taken from w2 {list(w2)} (got R={rows})"
        )
    for name, bias, expected in (("b13", b13, (experts, rows)), ("b2", b2, (experts, hidden))):
        if bias is not None and tuple(bias.shape) != expected:
            raise MoEConfigError(f"{name}: expected shape {list(expected)} (got {list(bias.shape)})")


def _transposed(w13: tuple[int, ...], w2: tuple[int, ...]) -> str | None:
    """The message for ``w13`` given as ``[E, H, R]`` and/or ``w2`` as ``[E, I, H]`` (an ``[in, out]``
    layout read the other way), when the shapes say so; None otherwise."""
    if w13[0] != w2[0]:
        return None
    flip = lambda shape: (shape[0], shape[2], shape[1])  # noqa: E731
    for names, (as13, as2) in (("w13", (flip(w13), w2)), ("w2", (w13, flip(w2))),
                               ("w13 and w2", (flip(w13), flip(w2)))):
        if as13[2] == as2[1] and as13[1] in (as2[2], 2 * as2[2]):
            fix = ", ".join(f"{name}.transpose(1, 2)" for name in names.split(" and "))
            return (
                f"{names}: transposed, by their shapes (got w13 {list(w13)}, w2 {list(w2)}); expected "
                f"w13 {list(as13)} as [E, R, H] (R = 2I rows [gate; up], or I when not gated) and "
                f"w2 {list(as2)} as [E, H, I]; pass {fix}"
            )
    return None


def expected_scales(
    fmt: QuantFormat, shape: tuple[int, int, int]
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """``(scale shape, global_scale shape)`` of a weight of unpacked shape ``[E, N, K]`` in ``fmt``.

    The weight column of the table in moe/quant/tensor.py, which has no function for it yet.
    """
    experts, rows, cols = shape
    block_rows, block_cols = FP8_BLOCK_SHAPE
    table = {
        QuantFormat.NONE: (None, None),
        QuantFormat.FP8_TENSOR: ((experts,), None),
        QuantFormat.FP8_ROW: ((experts, rows, 1), None),
        QuantFormat.FP8_BLOCK: ((experts, -(-rows // block_rows), -(-cols // block_cols)), None),
        QuantFormat.MXFP8: ((experts, rows, cols // MX_BLOCK), None),
        QuantFormat.MXFP4: ((experts, rows, cols // MX_BLOCK), None),
        QuantFormat.NVFP4: ((experts, rows, cols // NVFP4_BLOCK), (experts,)),
    }
    return table[fmt]


def _store(x: torch.Tensor, fmt: QuantFormat) -> QuantizedTensor:
    if fmt is QuantFormat.NONE:  # built directly: quantize() would scan for NaN again
        return QuantizedTensor(data=x.contiguous(), scale=None, fmt=fmt, role="weight")
    return quantize(x.contiguous(), fmt, "weight")


def _size_mismatches(weights: ExpertWeights, problem: "MoEProblem") -> list[str]:
    reasons = []
    for name, (dims, shape) in list(expected_dense_shapes(problem, problem.local_num_experts).items())[:2]:
        got = tuple(getattr(weights, name).shape)
        if got != shape:
            reasons.append(f"{name}: the weights are {list(got)}, the problem needs {dims} = {list(shape)}")
    sizes = (
        ("num_experts (local)", weights.num_experts, problem.local_num_experts),
        ("hidden_size H", weights.hidden_size, problem.hidden_size),
        ("intermediate_size I", weights.intermediate_size, problem.intermediate_size),
    )
    for name, got, want in sizes:
        if got != want:
            reasons.append(f"{name}: the weights have {got}, the problem {want}")
    rows, inter, activation = weights.w13_rows, problem.intermediate_size, problem.activation
    if rows != problem.w13_rows and not activation.is_gated and rows == 2 * inter:
        reasons.append(
            f"w13 has 2I={rows} rows ([gate; up]) but activation {activation} is not gated and reads "
            f"I={inter} rows; load the weights of a non-gated model or choose a gated activation"
        )
    elif rows != problem.w13_rows and activation.is_gated and rows == inter:
        reasons.append(
            f"w13 has I={rows} rows but activation {activation} is gated and needs 2I={2 * inter} "
            "rows [gate; up]; load gate and up weights or choose a non-gated activation"
        )
    elif rows != problem.w13_rows:
        reasons.append(
            f"w13 rows: the weights have {rows}, activation {activation} needs {problem.w13_rows}"
        )
    return reasons


def _storage_mismatches(weights: ExpertWeights, problem: "MoEProblem") -> list[str]:
    reasons = []
    both = weights.b13 is not None and weights.b2 is not None
    if weights.has_bias != problem.has_bias or (problem.has_bias and not both):
        present = [n for n in ("b13", "b2") if getattr(weights, n) is not None] or ["none"]
        needs = "both b13 and b2" if problem.has_bias else "none"
        reasons.append(
            f"biases: problem.has_bias={problem.has_bias} needs {needs} "
            f"(the weights have {', '.join(present)})"
        )
    fmt = weights.weight_format
    if fmt != problem.quant.weight:
        reasons.append(
            f"weight format: the weights are {fmt} but problem.quant.weight is {problem.quant.weight}; "
            "convert them with moe.loaders.requantize(weights, problem.quant)"
        )
    elif fmt is QuantFormat.NONE and weights.w13.data.dtype != problem.dtype:
        reasons.append(
            f"dtype: the unquantized weights are {weights.w13.data.dtype} "
            f"but problem.dtype is {problem.dtype}"
        )
    for name in ("w13", "w2"):
        q = getattr(weights, name)
        scale, global_scale = expected_scales(q.fmt, tuple(q.shape))
        for field, want in (("scale", scale), ("global_scale", global_scale)):
            tensor = getattr(q, field)
            got = None if tensor is None else tuple(tensor.shape)
            if got != want:
                reasons.append(f"{name}.{field}: expected shape {want} for {q.fmt} (got {got})")
    return reasons
