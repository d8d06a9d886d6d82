"""Whether a prepare/finalize class and an experts class can work together: a pure function of their
declarations (`moe.prepare_finalize.base.Transport`, `moe.experts.base.Capabilities`) and the problem.

The oracle asks it of every surviving pair without building anything; ``ModularKernel`` asks it of its
two halves' classes when it is composed, so a kernel that exists has passed the same checks.
"""

from __future__ import annotations

from moe.experts.base import Experts
from moe.formats import ActivationFormat, OutputKind
from moe.platform import Platform
from moe.prepare_finalize.base import PrepareFinalize
from moe.problem import MoEProblem
from moe.quant import QuantFormat


def activation_quant(experts_cls: type[Experts], problem: MoEProblem) -> QuantFormat:
    """The format prepare must quantize activations to: none if the experts quantize themselves."""
    if experts_cls.capabilities.quantizes_input:
        return QuantFormat.NONE
    return problem.quant.activation


def composition_problems(
    pf_cls: type[PrepareFinalize], experts_cls: type[Experts], problem: MoEProblem, platform: Platform | None
) -> list[str]:
    """Every reason the two classes cannot work together on ``problem`` and ``platform``; empty when they can.

    ``platform=None`` checks the declarations only (what the oracle asks of a pair whose classes it
    checked on the platform already, and the conformance kit of a format); a kernel that will run
    always passes its platform, so a backend that would compute wrongly or not at all there (Triton's
    CPU interpreter with bfloat16, a CUDA-only kernel on a CPU) is refused when it is composed.
    """
    transport, cap = pf_cls.transport, experts_cls.capabilities
    pf_name, experts_name = pf_cls.name, experts_cls.name
    problems = []
    if transport.format not in cap.formats:
        takes = ", ".join(sorted(f.value for f in cap.formats))
        problems.append(f"{pf_name} produces the {transport.format.value} format but {experts_name} takes {takes}")
    if transport.format is ActivationFormat.BATCHED and cap.output is OutputKind.REDUCED:
        problems.append(f"{experts_name} declares reduced output, which the batched format cannot carry")
    wanted = activation_quant(experts_cls, problem)
    if wanted is not QuantFormat.NONE and wanted not in transport.quant_formats:
        problems.append(f"{experts_name} wants {wanted.value} activations, which {pf_name} cannot produce")
    problems += [f"{pf_name}: {r}" for r in pf_cls.check(problem, platform)]
    if platform is not None:
        problems += [f"{experts_name} on {platform.name}: {r}" for r in experts_cls.check(problem, platform)]
    return problems
