"""The grouped MoE GEMM: ``out[row] = act(a[row] @ w[expert(row)].T + bias)`` for routed rows.

Rows come either from a `BlockLayout` (standard format, ``SortedRows``) or from per-expert buffers
(batched format, ``BatchedRows``). With a gated activation the weights hold ``[gate; up]`` (2N rows)
and the output has N columns; otherwise the output has the weights' N rows. The twin
`grouped_gemm_reference` states the same in plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.activation import Activation, ActivationKind
from moe.errors import MoEConfigError
from moe.experts._triton import cdiv, kernels, next_power_of_2
from moe.experts._triton.align import BlockLayout, experts_pad
from moe.experts._triton.config import TileConfig
from moe.experts._triton.weights import WeightOperand
from moe.quant import QuantFormat

QUANT_CODES = {
    QuantFormat.NONE: 0,
    QuantFormat.FP8_TENSOR: 1,
    QuantFormat.FP8_ROW: 2,
    QuantFormat.FP8_BLOCK: 3,
    QuantFormat.MXFP4: 4,
    QuantFormat.NVFP4: 5,
    QuantFormat.MXFP8: 6,
}
_FP8_FORMATS = (QuantFormat.FP8_TENSOR, QuantFormat.FP8_ROW, QuantFormat.FP8_BLOCK)
ACTIVATION_CODES = {
    None: 0,
    ActivationKind.SILU: 1,
    ActivationKind.GELU: 2,
    ActivationKind.SWIGLU_OAI: 3,
    ActivationKind.RELU2: 4,
}


def activation_code(activation: Activation | None) -> int:
    """The kernels' ACTIVATION switch for ``activation`` (0: none)."""
    return ACTIVATION_CODES[None if activation is None else activation.kind]


def activation_args(activation: Activation | None) -> tuple[float, float, float]:
    """The kernels' ``alpha, beta, limit`` for ``activation`` (zeros where it takes none)."""
    if activation is None or activation.alpha is None:
        return (0.0, 0.0, 0.0)
    return (activation.alpha, activation.beta, activation.limit)


@dataclass(frozen=True)
class SortedRows:
    """Standard format: rows of a `BlockLayout`; A row = slot // a_row_div, output row = slot."""

    layout: BlockLayout
    num_slots: int  # M * k: the sentinel
    a_row_div: int  # k when A is the token-major input, 1 when A is indexed by slot


@dataclass(frozen=True)
class DirectRows:
    """Standard format without sorting: one program per slot, expert from the top-k ids."""

    topk_ids: torch.Tensor  # int32 [M*k] global ids
    expert_map: torch.Tensor | None  # int32 [E] global -> local (-1 elsewhere); None: identity
    a_row_div: int  # k when A is the token-major input, 1 when A is indexed by slot


@dataclass(frozen=True)
class BatchedRows:
    """Batched format: A and output rows ``e * T + m`` for ``m < counts[e]``."""

    counts: torch.Tensor  # int32 [E_local]
    rows_per_expert: int  # T


# the kernel's ROWS switch: where a program's rows come from (_gemm.py's row sources)
ROW_CODES = {SortedRows: 0, BatchedRows: 1, DirectRows: 2}


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """``n`` strides of ``t``, missing (or all, for None / 0-dim) ones as 0."""
    strides = () if t is None else tuple(t.stride())
    return (strides + (0,) * n)[:n]


def bias_args(w: WeightOperand) -> tuple[torch.Tensor, tuple[int, int]]:
    """(the bias operand, its expert and column strides) of the sorted-row launches: ``w.bias``, or the weights
    standing in with zero strides (the kernels read it only with ``HAS_BIAS``)."""
    return (w.bias if w.bias is not None else w.data), _strides(w.bias, 2)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, fully resolved: what `grouped_gemm` runs and what the tuner precompiles."""

    grid: tuple[int, ...]
    args: tuple  # positional: tensors and ints
    constexprs: dict  # keyword: the compile-time switches, num_warps and num_stages
    kernel: tuple[str, str] = ("gemm", "moe_gemm_kernel")  # (the `kernels` module, the kernel's name)

    def run(self) -> None:
        getattr(kernels(self.kernel[0]), self.kernel[1])[self.grid](*self.args, **self.constexprs)

    def compile_spec(self) -> tuple:
        """Picklable stand-in (tensors replaced by their dtypes) for `precompile` in another process."""
        args = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in self.args)
        return self.grid, args, self.constexprs, self.kernel

    def compile_specs(self) -> list[tuple]:
        """The `compile_spec` of every kernel this step launches (as `LaunchSequence.compile_specs`)."""
        return [self.compile_spec()]


@dataclass(frozen=True)
class LaunchSequence:
    """Launches run in order as one step, e.g. the TMA-A path's row gather and then its GEMM."""

    launches: tuple[Launch, ...]

    def run(self) -> None:
        for launch in self.launches:
            launch.run()

    def compile_specs(self) -> list[tuple]:
        return [launch.compile_spec() for launch in self.launches]


def precompile(spec: tuple) -> str | None:
    """Compiles the kernel of a `Launch.compile_spec` into Triton's cache; the error text, if any."""
    grid, args, constexprs, (module, name) = spec
    try:
        getattr(kernels(module), name).warmup(*args, grid=grid, **constexprs)
    except Exception as error:  # noqa: BLE001 -- e.g. a tile that does not fit shared memory
        return f"{type(error).__name__}: {error}"
    return None


def gemm_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: WeightOperand,
    out: torch.Tensor,
    rows: SortedRows | DirectRows | BatchedRows,
    activation: Activation | None,
    block_m: int,
    tile: TileConfig,
) -> Launch:
    """The launch of `grouped_gemm` (see there)."""
    if tile.tma_a:
        raise MoEConfigError(f"a tma_a=True tile runs only in the standard format's sorted path (gemm_tma_a.py), "
                             f"not with {type(rows).__name__} (got {tile}); use tma_a=False here")
    gated = activation is not None and activation.is_gated
    n_out = out.shape[-1]
    k = w.k
    n_tiles = cdiv(n_out, tile.block_n)
    has_map, num_experts = False, 0
    if isinstance(rows, SortedRows):
        layout = rows.layout
        num_m_blocks = layout.max_blocks
        grid = (num_m_blocks * n_tiles,)
        num_experts = layout.expert_counts.numel()
        sorted_args = (layout.sorted_slots, layout.expert_ends, layout.expert_ends, layout.expert_counts)
        num_slots, per_expert, a_row_div = rows.num_slots, 1, rows.a_row_div
    elif isinstance(rows, DirectRows):
        num_m_blocks = rows.topk_ids.numel()
        grid = (num_m_blocks * n_tiles,)
        has_map = rows.expert_map is not None
        emap = rows.expert_map if has_map else rows.topk_ids
        sorted_args = (rows.topk_ids, emap, rows.topk_ids, rows.topk_ids)
        num_slots, per_expert, a_row_div = num_m_blocks, 1, rows.a_row_div
    else:
        num_m_blocks = cdiv(rows.rows_per_expert, block_m)
        grid = (num_m_blocks * n_tiles, rows.counts.numel())
        sorted_args = (rows.counts, rows.counts, rows.counts, rows.counts)
        num_slots, per_expert, a_row_div = 0, rows.rows_per_expert, 1
    dummy = w.data  # stands in for absent scales; never read
    bias, bias_strides = bias_args(w)
    args = (
        a, a_scale if a_scale is not None else dummy, w.data,
        w.descriptor(tile.block_n, tile.block_k) if tile.tma else dummy,
        w.scale if w.scale is not None else dummy, w.global_scale if w.global_scale is not None else dummy,
        bias, out,
        *sorted_args,
        num_m_blocks, num_slots, per_expert, num_experts, n_out, k, w.data.shape[1],
        a.stride(0), a.stride(1), *_strides(a_scale, 2),
        *w.data.stride(), *_strides(w.scale, 3), *bias_strides, out.stride(0), out.stride(1),
        *activation_args(activation),
    )
    weight_only = w.fmt in _FP8_FORMATS and a_scale is None
    assert not weight_only or w.data.dtype == torch.uint8, "weight-only fp8 reads the e4m3 bits as uint8"
    assert w.fmt is not QuantFormat.MXFP8 or a_scale is None, "MXFP8 runs weight-only: unquantized activations"
    constexprs = dict(
        ROWS=ROW_CODES[type(rows)], HAS_MAP=has_map, A_ROW_DIV=a_row_div, GATED=gated,
        ACTIVATION=activation_code(activation),
        QUANT=QUANT_CODES[w.fmt], WEIGHT_ONLY=weight_only, HAS_BIAS=w.bias is not None, EVEN_K=k % tile.block_k == 0,
        IEEE=a.dtype == torch.float32, E_PAD=experts_pad(num_experts), W_TMA=tile.tma,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return Launch(grid, args, constexprs)


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: WeightOperand,
    out: torch.Tensor,
    rows: SortedRows | DirectRows | BatchedRows,
    activation: Activation | None,
    block_m: int,
    tile: TileConfig,
) -> torch.Tensor:
    """Launches the kernel (no allocation). ``a [rows, K]``, ``out [rows_out, N_out]`` row-major.
    fp8 weights with unquantized ``a`` (no ``a_scale``) run weight-only: their e4m3 bits (uint8, see
    weights.py) are decoded in registers; MXFP8 weights always do."""
    gemm_launch(a, a_scale, w, out, rows, activation, block_m, tile).run()
    return out


def grouped_gemm_reference(
    a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor,
    activation: Activation | None,
) -> torch.Tensor:
    """Torch twin in float32: ``a [n, K]`` dequantized rows, ``w [E, N, K]`` dequantized weights,
    ``experts [n]`` the local expert of each row -> ``[n, N_out]``."""
    h = torch.einsum("nk,nok->no", a.float(), w.float()[experts.long()])
    if bias is not None:
        h = h + bias.float()[experts.long()]
    return h if activation is None else activation(h)
