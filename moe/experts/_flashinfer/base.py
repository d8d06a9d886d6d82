"""What the FlashInfer experts share: their modes' shape, one constructor, the NVFP4 activation scale.

Each FlashInfer backend runs a different kernel (or kernel argument set) per quantization scheme. It
declares them in one table, ``{scheme: flashinfer_mode(...)}``, whose `moe.experts.base.Mode` carries
the scheme's constraints and, as its ``strategy``, the code that serves it (weight conversion, extra
buffers, kernel arguments); ``FlashInferExperts.__init__`` picks the problem's. Architectures are
exact sets: FlashInfer ships prebuilt kernels per compute capability.
"""

from __future__ import annotations

import torch

from moe.activation import ActivationKind
from moe.experts.base import Archs, Experts, Mode
from moe.experts._flashinfer.layouts import Geometry
from moe.formats import ActivationFormat, Dispatched, DispatchShape
from moe.problem import MoEProblem
from moe.quant import QuantFormat, quantize
from moe.router import TopK
from moe.workspace import WorkspaceShapes

SM90_ONLY = Archs.exactly(90)
SM89_TO_SM121 = Archs.exactly(89, 90, 100, 103, 107, 110, 120, 121)
SM100_FAMILY = Archs.exactly(100, 103)  # trtllm-gen cubins and CuTe-DSL NVFP4 in FlashInfer 0.7.2
SM100_PLUS = Archs.exactly(100, 103, 107, 110, 120, 121)

E4M3_MAX = 448.0
NVFP4_GLOBAL_RANGE = E4M3_MAX * 6.0  # e4m3 block scale max x e2m1 max


def flashinfer_mode(name: str, archs: Archs, activations=frozenset(ActivationKind), *, h_align: int, i_align: int,
                    i_align_nongated: int | None = None, pads: bool = True, bias: bool = False,
                    features: tuple[str, ...], strategy: object = None) -> Mode:
    """A FlashInfer scheme: bf16 activations, ``features`` of the installed flashinfer it calls (the
    names of ``library.FEATURE_SOURCES``), reasons naming the kernel ``name``."""
    return Mode(activations=frozenset(activations), dtypes=frozenset({torch.bfloat16}), bias=bias, archs=archs,
                h_align=h_align, i_align=i_align, i_align_nongated=i_align_nongated, pads=pads,
                library="flashinfer", features=features, name=name, strategy=strategy)


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): FlashInfer's autotuner buckets token counts so."""
    return 1 << max(n - 1, 0).bit_length()


def tune_max_tokens(problem: MoEProblem) -> int:
    """``max_tokens`` up to a power of two: the largest token count the autotuner profiles."""
    return power_of_two_at_least(problem.max_tokens)


class FlashInferExperts(Experts):
    """The constructor every FlashInfer backend shares (no ``name``: not registered itself).

    ``mode`` and ``strategy``: the problem's scheme in the class's table; ``geometry``: H and I as the
    model has them and padded as the kernel sees them; ``intermediate_scale``: the static dequant
    multiplier of the intermediate activation where the kernel quantizes it (fp8 per tensor, nvfp4;
    the reference quantizes it dynamically, so pass a calibrated value for models whose intermediates
    are far from O(1)); ``tune_max_tokens``: max_tokens up to a power of two, the autotuner's bound;
    ``local_experts``: this rank's (first global expert, count), a block (``ExpertLayout.BLOCK``).
    """

    def __init__(self, problem: MoEProblem, *, intermediate_scale: float = 1.0):
        super().__init__(problem)
        self.mode = self.capabilities.modes[problem.quant]
        self.strategy = self.mode.strategy
        self.geometry = self.geometry_of(problem)
        self.intermediate_scale = float(intermediate_scale)
        self.tune_max_tokens = tune_max_tokens(problem)
        first = problem.parallel.global_to_local(problem.num_experts).index(0)
        self.local_experts = (first, problem.local_num_experts)

    @classmethod
    def geometry_of(cls, problem: MoEProblem) -> Geometry:
        """H and I of ``problem`` as the model has them and padded as its mode's kernel sees them (what
        ``declared_workspace`` sizes buffers with, without an instance)."""
        return Geometry.of(problem, cls.capabilities.modes[problem.quant].padded_sizes(problem))

    @classmethod
    def declared_workspace(cls, problem: MoEProblem, dispatch: DispatchShape) -> WorkspaceShapes:
        """The output, the padded input where H is padded, the mode strategy's ``buffers`` and the
        library's own scratch (``scratch_bytes``) -- from the class and the problem alone."""
        rows, g = dispatch.max_rows, cls.geometry_of(problem)
        return cls.mode_workspace(problem, g, rows, cls.scratch_bytes(problem, g, rows))

    @classmethod
    def mode_workspace(cls, problem: MoEProblem, g: Geometry, rows: int, scratch_bytes: int) -> WorkspaceShapes:
        """The buffers of ``rows`` rows with ``scratch_bytes`` of library scratch."""
        buffers = cls.base_buffers(problem, g, rows)
        buffers.update(cls.capabilities.modes[problem.quant].strategy.buffers(problem, g, rows))
        buffers["library"] = ((scratch_bytes,), torch.uint8)
        return WorkspaceShapes.of(**buffers)

    @classmethod
    def base_buffers(cls, problem: MoEProblem, g: Geometry, rows: int) -> dict:
        """What every mode of the backend writes: its output (and input) buffers."""
        return {}

    @classmethod
    def scratch_bytes(cls, problem: MoEProblem, g: Geometry, rows: int) -> int:
        """The library's own scratch for up to ``rows`` rows (an estimate where it cannot be asked)."""
        return 0


def nvfp4_activation_scale(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """FlashInfer's per-call NVFP4 activation global scale, a quant multiplier ``448 * 6 / amax(x)``,
    written into ``out`` (broadcast to its shape)."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    return out.copy_(NVFP4_GLOBAL_RANGE / amax)


def synthetic_dispatch(problem: MoEProblem, rows: int, device: torch.device,
                       fmt: QuantFormat = QuantFormat.NONE) -> Dispatched:
    """``rows`` random tokens in ``fmt``, routed round-robin over the local experts (for warm-up and
    benchmarks)."""
    x = torch.randn(rows, problem.hidden_size, device=device).to(problem.dtype)
    first = problem.parallel.global_to_local(problem.num_experts).index(0)
    slots = torch.arange(rows * problem.top_k, device=device).view(rows, problem.top_k)
    ids = (first + slots % problem.local_num_experts).to(torch.int32)
    weights = torch.full((rows, problem.top_k), 1.0 / problem.top_k, device=device)
    return Dispatched(ActivationFormat.STANDARD, quantize(x, fmt, "activation"), TopK(ids, weights))
