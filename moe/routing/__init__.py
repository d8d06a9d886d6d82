"""Routing kinds, declared once as data; `moe.router.Router` composes its routing from them.

A routing turns router logits ``[M, E]`` into a `TopK` in four steps, each named by the kind:

1. **score**: ``softmax`` over the E logits, elementwise ``sigmoid``, or ``sqrtsoftplus``
   (``sqrt(softplus(x))``, DeepSeek-V4's ``scoring_func``), in float32;
2. **selection**: ``scores`` -- the k best of ``scores + correction_bias`` (bias optional), first
   restricted to the ``topk_group`` best of ``n_group`` groups where the kind takes groups; the
   weights are the unbiased scores of the chosen experts. ``logits`` -- the k best raw logits; the
   weights are the score function applied to those k values only (a softmax over the k, or a
   sigmoid of each). ``table`` -- the experts come from a token id -> expert ids table (hash
   routing); the weights are the scores of those experts;
3. **renormalize** (the kind's default, which ``Router(renormalize=...)`` may override unless the
   kind's weights sum to 1 by construction): divide the k weights by their sum;
4. **scale**: multiply by ``routed_scaling_factor``.

Two facts about the layer around the router are declared here too: ``weight_on_input`` (the
router weight multiplies the expert's input, not its output: Llama-4) and, for every kind, the
``num_zero_experts`` identity experts numbered after the E real ones (LongCat-Flash).

The reference of every kind is `moe.routing.reference.route_reference`; the fused Triton kernel
(`moe.routing.fused`) computes the same ids and the same weights up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

SCORE_NAMES = ("softmax", "sigmoid", "sqrtsoftplus")
SELECTION_NAMES = ("scores", "logits", "table")


@dataclass(frozen=True)
class RoutingKind:
    """One routing, as data. ``ROUTING_KINDS[name]`` is read by `Router`, its checks, the reference,
    the fused kernel and the layer; nothing else lists what a routing does."""

    name: str  # the Router's ``routing`` argument
    score: str  # one of SCORE_NAMES
    selection: str  # one of SELECTION_NAMES
    renormalize: bool  # the default of Router.renormalize
    always_normalized: bool = False  # the weights sum to 1 by construction: renormalize=False is refused
    groups: bool = False  # takes n_group / topk_group (selection "scores")
    bias: bool = False  # takes correction_bias (selection "scores")
    weight_on_input: bool = False  # the layer multiplies the expert's input by the weight (top_k=1 only)
    models: str = ""  # who uses it, and the transformers module it reproduces


ROUTING_KINDS: dict[str, RoutingKind] = {
    kind.name: kind
    for kind in (
        RoutingKind("softmax", "softmax", "scores", renormalize=True,
                    models="Mixtral, Qwen2-MoE/Qwen3-MoE (norm_topk_prob = renormalize; Qwen2-MoE's default is False)"),
        RoutingKind("gpt_oss", "softmax", "logits", renormalize=True, always_normalized=True,
                    models="GPT-OSS: top-k logits, then a softmax over those k"),
        RoutingKind("deepseek_v3", "sigmoid", "scores", renormalize=True, groups=True, bias=True,
                    models="DeepSeek-V3/R1, Nemotron-3 (noaux_tc)"),
        RoutingKind("deepseek_v4", "sqrtsoftplus", "scores", renormalize=True, bias=True,
                    models="DeepSeek-V4 moe layers (transformers DeepseekV4TopKRouter)"),
        RoutingKind("deepseek_v4_hash", "sqrtsoftplus", "table", renormalize=True,
                    models="DeepSeek-V4 hash_moe layers (DeepseekV4HashRouter: tid2eid[input_ids])"),
        RoutingKind("llama4", "sigmoid", "logits", renormalize=False, weight_on_input=True,
                    models="Llama-4 (Llama4Router: top-k logits, sigmoid of each; weight applied to the input)"),
        RoutingKind("longcat_flash", "softmax", "scores", renormalize=False, bias=True,
                    models="LongCat-Flash (softmax, bias-corrected choice, unnormalized; with zero experts)"),
    )
}

ROUTING_NAMES = tuple(ROUTING_KINDS)
