"""The cost model: a roofline of the MoE problem on a platform, scaled by a backend's efficiency profile.

For M tokens on one rank (k slots each; under expert parallelism every rank sends its M tokens, and
this rank's E_local experts receive about M * k slots)::

    experts hit   = E_local * (1 - (1 - k/E) ** (M * ep_size))        expected, for random routing
                    (or the number a measurement's routing hit: ``roofline(..., hits=)``)
    weight bytes  = experts hit * (w13_rows * H + H * I) * bits(weight format) / 8
    act. bytes    = slots * (H * in_bytes + 2 * I * dtype_bytes + H * dtype_bytes)
                    (gathered input, the intermediate written and read, each slot's output)
    FLOPs         = 2 * slots * H * (w13_rows + I)
    roofline_us   = max(bytes / memory_bandwidth, FLOPs / peak_flops(precision))
    experts us    = overhead_us + roofline_us / efficiency        (efficiency, overhead: the profile)

The activation bytes count what an experts stage moves when its two GEMMs run as two kernels, as
every backend here runs them: each of the M * k slots gathers its token's row, writes and reads its
intermediate row, and writes its output row. ``python -m moe bench`` divides this same roofline by
its measured times ("% of roofline"), so its fractions and the efficiencies the oracle derives from
measured profile points are one quantity.

Shared experts (a dense MLP beside the routed ones) are costed as a one-expert, top-1 problem, whose
roofline is a dense MLP's, with the ``shared_experts`` profile entry. On a GPU, up to
``SHARED_OVERLAP_MAX_TOKENS`` tokens, they run on a second stream beside the routed part, so the layer
takes ``max(routed, shared) + STREAM_FORK_JOIN_US``; above it, and on a CPU, they run first, so it takes
the sum.

The GEMM precision is the activations' format (fp8 -> "fp8", nvfp4 -> "fp4") or, with unquantized
activations (W4A16, bf16), the dtype. A weight-only mode (`Mode.weight_only`: e.g. nvfp4 on an H100, fp8
on an A100) reads the activations unquantized whatever the scheme says: the caller passes
``activation=QuantFormat.NONE``, so its weights count at their quantized width and its input bytes and
FLOPs at the dtype's; where its kernels are another scheme's (W4A8 mxfp4 run as W4A16), it reads that
scheme's measurements (`MoEProblem.scheme_run_as`). The prepare/finalize half costs its profile's overhead plus the
bytes it moves: the batched format scatters and gathers every slot through memory, a prepare that
quantizes activations reads and writes them once, and under expert parallelism each token crosses
the interconnect once per remote rank owning any of its experts, and its result comes back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

from moe.errors import MoEConfigError
from moe.formats import ActivationFormat
from moe.oracle.profile import (
    DEFAULT_EFFICIENCY,
    DEFAULT_OVERHEAD_US,
    Profile,
    ProfileEntry,
    ProfileShape,
    measured_on,
)
from moe.platform import Platform
from moe.problem import MoEProblem
from moe.quant import QuantFormat

_F = QuantFormat
# bits per stored weight element, scales included (block 128x128 fp32 scales and per-row scales are < 0.01)
_WEIGHT_BITS = {_F.FP8_TENSOR: 8.0, _F.FP8_ROW: 8.0, _F.FP8_BLOCK: 8.0, _F.MXFP8: 8.25, _F.MXFP4: 4.25, _F.NVFP4: 4.5}
_ACTIVATION_PRECISION = {_F.FP8_TENSOR: "fp8", _F.FP8_ROW: "fp8", _F.FP8_BLOCK: "fp8", _F.MXFP8: "fp8", _F.NVFP4: "fp4"}
_DTYPE_PRECISION = {2: "bf16", 4: "fp32"}
SHARED_EXPERTS = "shared_experts"  # the profile's name for the shared MLP (three dense GEMMs)
# The fork and join of the second stream: two event records and two stream waits, each about a
# microsecond of host time, and the first shared GEMM's launch queued behind the fork.
STREAM_FORK_JOIN_US = 4.0
# Up to this M the shared experts overlap the routed ones (FusedMoE does the same). Measured on an H100
# (benchmarks/results/shared_overlap_nvidia-h100.md, DeepSeek-V3 EP8 slice + its shared expert): the
# second stream saves 15-17 us at M = 1-64, nothing at 256 and 4096, and costs 446 us at 1024, where the
# routed GEMMs already fill the GPU and the two streams' kernels contend for its SMs.
SHARED_OVERLAP_MAX_TOKENS = 64


@dataclass(frozen=True)
class Roofline:
    """Bytes and FLOPs of one forward of M tokens, and the time each takes at the platform's peak."""

    tokens: int
    experts_hit: float
    weight_bytes: float
    activation_bytes: float
    flops: float
    precision: str  # the GEMMs' precision: "bf16", "fp8", "fp4", ...
    memory_us: float
    compute_us: float

    @property
    def us(self) -> float:
        return max(self.memory_us, self.compute_us)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_us >= self.compute_us else "compute"


@dataclass(frozen=True)
class Estimate:
    """One half's estimated time: ``overhead_us + roofline_us / efficiency``, and where the numbers came from."""

    us: float
    roofline_us: float
    efficiency: float
    overhead_us: float
    basis: str  # "estimated (h100, bf16) (estimates.yaml)", "measured (bench.yaml)", ...


def expected_experts_hit(num_experts: int, top_k: int, local_experts: int, routed_tokens: int) -> float:
    """Expected distinct local experts hit when ``routed_tokens`` tokens each pick k of E at random."""
    return local_experts * (1.0 - (1.0 - top_k / num_experts) ** routed_tokens)


def weight_bits(fmt: QuantFormat, dtype_bytes: int) -> float:
    return _WEIGHT_BITS.get(fmt, 8.0 * dtype_bytes)


def gemm_precision(problem: MoEProblem, activation: QuantFormat | None = None) -> str:
    """The GEMMs' precision; ``activation``: the format the kernel reads activations in (default the scheme's)."""
    act = problem.quant.activation if activation is None else activation
    if act is not _F.NONE:
        return _ACTIVATION_PRECISION[act]
    return "fp16" if problem.quant_name == "fp16" else _DTYPE_PRECISION[problem.dtype.itemsize]


def roofline(problem: MoEProblem, platform: Platform, tokens: int, hits: float | None = None,
             activation: QuantFormat | None = None) -> Roofline:
    """The roofline of one forward of ``tokens`` tokens on this rank (formulas in the module docstring).

    ``hits``: the number of local experts the routing hits, where it was measured (a benchmark's
    routing, averaged over its input sets); by default the number expected for random routing.
    ``activation``: the format the kernel reads activations in, where it is not the scheme's (NONE for
    a weight-only mode); by default the scheme's.
    Raises MoEConfigError for ``hits`` outside ``[0, local_num_experts]``.
    """
    p, dtype_bytes = problem, problem.dtype.itemsize
    if hits is None:
        hit = expected_experts_hit(p.num_experts, p.top_k, p.local_num_experts, tokens * p.parallel.ep_size)
    elif not 0 <= hits <= p.local_num_experts:
        raise MoEConfigError(f"roofline: hits must be in [0, local_num_experts={p.local_num_experts}] (got {hits!r})")
    else:
        hit = float(hits)
    slots = tokens * p.top_k
    weight_bytes = hit * (p.w13_rows * p.hidden_size + p.hidden_size * p.intermediate_size)
    weight_bytes *= weight_bits(p.quant.weight, dtype_bytes) / 8
    act = p.quant.activation if activation is None else activation
    in_bytes = weight_bits(act, dtype_bytes) / 8
    act_bytes = slots * (p.hidden_size * in_bytes + 2 * p.intermediate_size * dtype_bytes + p.hidden_size * dtype_bytes)
    flops = 2.0 * slots * p.hidden_size * (p.w13_rows + p.intermediate_size)
    precision = gemm_precision(p, act)
    return Roofline(
        tokens=tokens, experts_hit=hit, weight_bytes=weight_bytes, activation_bytes=act_bytes, flops=flops,
        precision=precision, memory_us=1e6 * (weight_bytes + act_bytes) / platform.memory_bandwidth,
        compute_us=1e6 * flops / platform.peak_flops(precision),
    )


# --- efficiency from profile points -----------------------------------------------------------------
# a backend's roofline in microseconds: (problem, platform, tokens) -> us; what measurements are divided into
RooflineUs = Callable[[MoEProblem, Platform, int], float]


def experts_roofline(activation: QuantFormat | None = None) -> RooflineUs:
    """The experts' `roofline` (``activation`` as there: the format the backend reads activations in)."""
    return lambda problem, platform, tokens: roofline(problem, platform, tokens, activation=activation).us


def transport_roofline(pf_format: ActivationFormat, quantizes: bool) -> RooflineUs:
    """A prepare/finalize's `transport_us` (a measured point counts as moving what this one moves)."""
    return lambda problem, platform, tokens: transport_us(pf_format, quantizes, problem, platform, tokens)


def _point_efficiency(point: ProfileEntry, platform: Platform, roofline_us: RooflineUs) -> tuple[float, float]:
    """(efficiency, overhead_us) of one point; a measurement is divided into its own shape's roofline."""
    if not point.measured:
        return point.efficiency, point.overhead_us
    shape_problem = point.shape.problem(point.quant, max(point.tokens, 1))
    bound = roofline_us(shape_problem, measured_on(point, platform), point.tokens)
    if bound <= 0:  # it moved no bytes (a prepare/finalize on one rank that copies nothing): all overhead
        return 1.0, point.measured_us
    return bound / point.measured_us, 0.0


def efficiency_at(points: tuple[ProfileEntry, ...], platform: Platform, tokens: int,
                  roofline_us: RooflineUs | None = None) -> tuple[float, float]:
    """(efficiency, overhead_us) at M=``tokens``: interpolated in log2(M) between points, held beyond them.
    ``roofline_us``: what measured points are divided into (default: `experts_roofline`)."""
    if not points:
        return DEFAULT_EFFICIENCY, DEFAULT_OVERHEAD_US
    roofline_us = roofline_us or experts_roofline()
    by_tokens: dict[int, list[tuple[float, float]]] = {}
    for point in points:  # other shapes' levels can hold several at one M: their mean, not whichever sorts first
        by_tokens.setdefault(point.tokens, []).append(_point_efficiency(point, platform, roofline_us))
    values = [(t, sum(e for e, _ in at) / len(at), sum(o for _, o in at) / len(at))
              for t, at in sorted(by_tokens.items())]
    if tokens <= values[0][0]:
        return values[0][1], values[0][2]
    for (t0, e0, o0), (t1, e1, o1) in zip(values, values[1:]):
        if tokens <= t1:
            w = (math.log2(tokens) - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
            return e0 + w * (e1 - e0), o0 + w * (o1 - o0)
    return values[-1][1], values[-1][2]


def _estimate(name: str, roofline_us: RooflineUs, problem: MoEProblem, platform: Platform, tokens: int,
              profile: Profile, peers: Iterable[str] = (), parallel: bool = False, scheme: str | None = None) -> Estimate:
    """``parallel``: a PrepareFinalize, whose measurements are matched at the problem's ``ep_size``;
    ``scheme``: whose measurements to read (default the problem's; `MoEProblem.scheme_run_as`)."""
    shape = ProfileShape.of(problem, parallel=parallel)
    points, basis = profile.points(name, platform, scheme or problem.quant_name, shape, peers, tokens=tokens)
    efficiency, overhead = efficiency_at(points, platform, tokens, roofline_us)
    us = roofline_us(problem, platform, tokens)
    return Estimate(overhead + us / efficiency, us, efficiency, overhead, basis)


def estimate_experts(name: str, problem: MoEProblem, platform: Platform, tokens: int, profile: Profile,
                     peers: Iterable[str] = (), activation: QuantFormat | None = None) -> Estimate:
    """Estimated time of Experts backend ``name`` for M=``tokens``; ``peers``, the experts backends it
    competes with, decide whether a generic estimate may stand in for a measurement (`Profile.points`);
    ``activation`` as for `roofline` (the format its mode reads activations in on ``platform``:
    `Mode.activation_format`)."""
    return _estimate(name, experts_roofline(activation), problem, platform, tokens, profile, peers,
                     scheme=problem.scheme_run_as(activation))


def transport_us(pf_format: ActivationFormat, quantizes: bool, problem: MoEProblem, platform: Platform,
                 tokens: int) -> float:
    """Roofline time of what a prepare/finalize moves: batched scatter/gather, quantization, all-to-all."""
    p, dtype_bytes = problem, problem.dtype.itemsize
    in_bytes = weight_bits(p.quant.activation, dtype_bytes) / 8 if quantizes else dtype_bytes
    slots = tokens * p.top_k
    local_bytes = tokens * p.hidden_size * (dtype_bytes + in_bytes) if quantizes else 0.0
    if pf_format is ActivationFormat.BATCHED:
        local_bytes += 2 * slots * p.hidden_size * (in_bytes + dtype_bytes)
    us = 1e6 * local_bytes / platform.memory_bandwidth
    ep = p.parallel.ep_size
    if ep > 1:
        # a token travels once to each rank owning any of its k experts, and its result comes back once
        ranks_reached = ep * (1.0 - (1.0 - p.top_k / p.num_experts) ** (p.num_experts / ep))
        remote_rows = tokens * ranks_reached * (ep - 1) / ep
        us += 1e6 * remote_rows * p.hidden_size * (in_bytes + dtype_bytes) / max(platform.interconnect_bandwidth, 1.0)
    return us


def estimate_transport(name: str, pf_format: ActivationFormat, quantizes: bool, problem: MoEProblem,
                       platform: Platform, tokens: int, profile: Profile) -> Estimate:
    """Estimated time of PrepareFinalize ``name`` when its prepare ``quantizes`` activations or not; its
    measurements (prepare + finalize per rank, `ProfileShape.ep_size`) are divided into `transport_us`."""
    return _estimate(name, transport_roofline(pf_format, quantizes), problem, platform, tokens, profile,
                     parallel=True)


@dataclass(frozen=True)
class SharedEstimate:
    """The shared experts' time by itself (``alone``) and how it adds to the routed part's."""

    alone: Estimate
    overlapped: bool  # True on a GPU up to SHARED_OVERLAP_MAX_TOKENS: a second stream beside the routed experts

    def layer_us(self, routed_us: float) -> float:
        """The layer's time when the routed part (prepare, experts, finalize) takes ``routed_us``."""
        if self.overlapped:
            return max(routed_us, self.alone.us) + STREAM_FORK_JOIN_US
        return routed_us + self.alone.us


def estimate_shared(shared: MoEProblem, platform: Platform, tokens: int, profile: Profile) -> SharedEstimate:
    """Estimated time of the shared MLP ``shared`` (a one-expert, top-1 problem) for M=``tokens``."""
    alone = _estimate(SHARED_EXPERTS, experts_roofline(), shared, platform, tokens, profile)
    return SharedEstimate(alone, overlapped=platform.is_cuda and tokens <= SHARED_OVERLAP_MAX_TOKENS)
