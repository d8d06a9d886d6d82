"""`moe`: Mixture-of-Experts layers for LLM inference, composed from swappable halves.

Vocabulary, used everywhere: M tokens, H hidden size, I intermediate size, E experts, k experts per
token (top-k); ``w13 [E, 2I, H]`` the first GEMM's weights with rows ``[gate; up]`` (``[E, I, H]`` for
non-gated activations), ``w2 [E, H, I]`` the second's; ``topk_ids`` / ``topk_weights`` the routing.

    hidden [M, H], router_logits [M, E]
      -> Router -> TopK
      -> ModularKernel(PrepareFinalize, Experts): prepare -> experts.apply -> finalize
      -> out [M, H]
"""

import warnings

# torch's CPU wheel does not require numpy but warns at import when it is missing; `moe` never uses
# numpy, so the base install (torch + pyyaml) stays quiet. Scoped to this one import: a program that
# imported torch first has already seen the warning, and no other warning is touched.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

import moe._requirements  # noqa: E402, F401  (first: it refuses an older torch by name)
from moe.activation import Activation, ActivationKind  # noqa: E402
from moe.errors import CacheWarning, MoEConfigError, MoEError, SlowPathWarning, UnsupportedError, WorkspaceError
from moe.experts import Capabilities, Experts, Mode, ReferenceExperts, TorchGroupedExperts
from moe.formats import ActivationFormat, Dispatched, DispatchShape, ExpertsOutput, OutputKind
from moe.kernel import ModularKernel
from moe.layer import FusedMoE
from moe.oracle import Plan, plan
from moe.platform import Platform
from moe.prepare_finalize import BatchedPrepareFinalize, LocalPrepareFinalize, PrepareFinalize
from moe.problem import MoEProblem, ParallelConfig
from moe.quant import QuantFormat, QuantizedTensor, QuantScheme
from moe.registry import BrokenPluginWarning, register_experts, register_prepare_finalize
from moe.router import Router, TopK
from moe.shared import SharedExperts, SharedExpertsConfig
from moe.weights import ExpertWeights
from moe.workspace import Workspace, WorkspaceManager, WorkspaceShapes

__version__ = "0.1.0"

__all__ = [
    "Activation",
    "ActivationFormat",
    "ActivationKind",
    "BatchedPrepareFinalize",
    "BrokenPluginWarning",
    "CacheWarning",
    "Capabilities",
    "DispatchShape",
    "Dispatched",
    "ExpertWeights",
    "Experts",
    "ExpertsOutput",
    "FusedMoE",
    "LocalPrepareFinalize",
    "MoEConfigError",
    "Mode",
    "MoEError",
    "MoEProblem",
    "ModularKernel",
    "OutputKind",
    "Plan",
    "ParallelConfig",
    "Platform",
    "PrepareFinalize",
    "QuantFormat",
    "QuantScheme",
    "QuantizedTensor",
    "SharedExperts",
    "SharedExpertsConfig",
    "SlowPathWarning",
    "ReferenceExperts",
    "Router",
    "TopK",
    "TorchGroupedExperts",
    "UnsupportedError",
    "Workspace",
    "WorkspaceError",
    "WorkspaceManager",
    "WorkspaceShapes",
    "plan",
    "register_experts",
    "register_prepare_finalize",
]
