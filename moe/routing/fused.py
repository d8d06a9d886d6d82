"""The fused routing kernel: score, bias, grouped top-k, renormalize and scale in one Triton launch.

`fused_route` is the launcher; its twin is `moe.routing.reference.route_reference` (same ids, ties
towards the lower index; weights equal up to float32 rounding). It serves every kind whose
selection is ``scores`` or ``logits`` (not the ``table`` of hash routing: a gather, nothing to fuse).

When it pays (`fused_pays`, read by `Router` on each call): the torch reference launches 6 kernels
for the simplest kind (cast, softmax, sort, two slices, sum/divide) and about 15 for grouped
DeepSeek-V3 routing, each a few microseconds of launch at decode sizes, plus a full sort of E per
row; the fused kernel is one launch whose work is ``k`` (plus ``2 * n_group + topk_group``) passes
of max/min over a row held in registers. So it runs on CUDA whenever it applies, as long as a row
fits one tile (E + Z <= MAX_FUSED_EXPERTS) and k passes stay cheaper than a sort (k <=
MAX_FUSED_TOP_K, an estimate that benchmarks/routing_time.py measures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe.routing import SCORE_NAMES
from moe.routing.topk import TopK

if TYPE_CHECKING:
    from moe.router import Router

MAX_FUSED_EXPERTS = 1024  # one row of logits as one register tile
MAX_FUSED_TOP_K = 32  # k rounds of max/min over the row; beyond this a sort is the better plan
# One row per warp, four rows per program: each row's max/min passes stay inside a warp (shuffles, no
# shared memory or barrier). Timed on an H100 in CUDA graphs against 1-16 rows and 1-8 warps
# (benchmarks/results/routing_warps_nvidia-h100.md): within 5% of the best at every M timed for Qwen3, GPT-OSS
# and grouped DeepSeek-V3 routing, 1.4-1.9x faster than the 2048-element tiles used before.
_ROWS_PER_PROGRAM = 4


def fused_supports(router: Router) -> bool:
    """True if the fused kernel computes ``router``'s routing (any device)."""
    return (
        router.kind.selection != "table"
        and router.num_choices <= MAX_FUSED_EXPERTS
        and router.top_k <= MAX_FUSED_TOP_K
    )


def fused_pays(router: Router, router_logits: torch.Tensor) -> bool:
    """True where `Router` should launch the fused kernel: CUDA logits and a routing it supports."""
    return router_logits.is_cuda and fused_supports(router)


def fused_route(router_logits: torch.Tensor, router: Router) -> TopK:
    """``router``'s routing of ``router_logits [M, E + Z]`` (validated by the caller) in one launch."""
    if not fused_supports(router):
        raise AssertionError(f"fused_route called for a routing it does not support: {router!r}")
    import triton  # noqa: PLC0415 (Triton at the first launch, not with moe)

    from moe.routing import _fused  # noqa: PLC0415

    kind = router.kind
    num_tokens, width = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    device = logits.device
    ids = torch.empty(num_tokens, router.top_k, dtype=torch.int32, device=device)
    weights = torch.empty(num_tokens, router.top_k, dtype=torch.float32, device=device)
    if num_tokens == 0:
        return TopK(ids, weights)
    block_e = triton.next_power_of_2(width)
    n_group = router.n_group or 1
    bias = router.correction_bias
    _fused.route_kernel[(triton.cdiv(num_tokens, _ROWS_PER_PROGRAM),)](
        logits, logits.stride(0), logits if bias is None else bias.to(device), ids, weights,
        num_tokens, width, float(router.routed_scaling_factor),
        K=router.top_k,
        SCORE=SCORE_NAMES.index(kind.score),
        ON_LOGITS=kind.selection == "logits",
        HAS_BIAS=bias is not None,
        N_GROUP=n_group,
        TOPK_GROUP=router.topk_group or 1,
        GROUP_SIZE=width // n_group,
        RENORMALIZE=bool(router.renormalize) and not kind.always_normalized,
        BLOCK_M=_ROWS_PER_PROGRAM,
        BLOCK_E=block_e,
        BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_K=triton.next_power_of_2(router.top_k),
        # a decode GEMM1 launched after this one may start at once (`moe.experts._triton.decode.pdl_roles`)
        LAUNCH_DEPENDENTS=_fused.pdl_supported(device),
        num_warps=_ROWS_PER_PROGRAM,
    )
    return TopK(ids, weights)
