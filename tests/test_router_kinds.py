"""The routing kinds added to the first three: hand-worked examples, validation, and the layer around them
(zero experts, weight on input, hash routing's token ids), the layer checked against transformers' blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe.errors import MoEConfigError
from moe.layer import FusedMoE
from moe.router import Router
from moe.routing import ROUTING_KINDS, ROUTING_NAMES, SCORE_NAMES, SELECTION_NAMES
from moe.routing.layer_inputs import fold_zero_experts

H, I = 16, 8  # noqa: E741


def sqrtsoftplus(x: float) -> float:
    return math.sqrt(math.log1p(math.exp(x)))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def assert_weights(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-7)


def test_declarations_are_well_formed():
    assert ROUTING_NAMES == tuple(ROUTING_KINDS)
    for kind in ROUTING_KINDS.values():
        assert kind.score in SCORE_NAMES and kind.selection in SELECTION_NAMES, kind
        assert not (kind.groups or kind.bias) or kind.selection == "scores", kind
        assert kind.models, kind


# ----------------------------------------------------------------------------------------------
# Hand-worked routings


def test_deepseek_v4_sqrtsoftplus_bias_and_scale():
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])  # expert 2 chosen by its bias; weighted by its own score
    topk = Router("deepseek_v4", 4, 2, correction_bias=bias, routed_scaling_factor=1.5)(logits)
    assert topk.ids.tolist() == [[2, 3]]
    s2, s3 = sqrtsoftplus(-1.0), sqrtsoftplus(2.0)
    assert_weights(topk.weights, [[1.5 * s2 / (s2 + s3), 1.5 * s3 / (s2 + s3)]])


def test_deepseek_v4_hash_takes_the_table_row_of_each_token():
    table = torch.tensor([[3, 1], [0, 2], [2, 3]])
    router = Router("deepseek_v4_hash", 4, 2, hash_table=table, renormalize=False)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    topk = router(logits, torch.tensor([2, 0]))
    assert topk.ids.tolist() == [[2, 3], [3, 1]]  # table order, not score order
    assert_weights(topk.weights, [[sqrtsoftplus(2), sqrtsoftplus(3)], [sqrtsoftplus(3), sqrtsoftplus(1)]])


def test_llama4_sigmoid_of_the_chosen_logits_unnormalized():
    logits = torch.tensor([[0.5, 3.0, -1.0, 3.0]])  # tie 1/3: the lower id first
    assert Router("llama4", 4, 1)(logits).ids.tolist() == [[1]]
    topk = Router("llama4", 4, 2)(logits)
    assert topk.ids.tolist() == [[1, 3]]
    assert_weights(topk.weights, [[sigmoid(3.0), sigmoid(3.0)]])


def test_longcat_zero_experts_are_routable_and_weights_unnormalized():
    logits = torch.tensor([[1.0, 0.0, 0.0, 2.0, 0.5]])  # E = 3 real experts, ids 3 and 4 are zero experts
    router = Router("longcat_flash", 3, 2, num_zero_experts=2, routed_scaling_factor=6.0)
    assert router.renormalize is False  # the kind's default, resolved
    probs = torch.softmax(logits, -1)[0].tolist()
    topk = router(logits)
    assert topk.ids.tolist() == [[3, 0]]
    assert_weights(topk.weights, [[6 * probs[3], 6 * probs[0]]])


def test_renormalize_default_comes_from_the_kind_and_repr_round_trips():
    assert Router("softmax", 8, 2).renormalize is True
    assert Router("llama4", 8, 1).renormalize is False
    router = Router("longcat_flash", 8, 2, num_zero_experts=4)
    assert eval(repr(router), {"Router": Router}) == router
    assert Router("longcat_flash", 8, 2, renormalize=True).renormalize is True


# ----------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(routing="deepseek_v4", num_experts=8, top_k=2, n_group=2, topk_group=1), "n_group is a deepseek_v3 option"),
        (dict(routing="llama4", num_experts=8, top_k=1, correction_bias=torch.zeros(8)), "correction_bias is a"),
        (dict(routing="deepseek_v4_hash", num_experts=8, top_k=2), "hash_table .* is required"),
        (dict(routing="softmax", num_experts=8, top_k=2, hash_table=torch.zeros(4, 2, dtype=torch.long)),
         "hash_table .* taken by no other"),
        (dict(routing="deepseek_v4_hash", num_experts=8, top_k=2, hash_table=torch.zeros(4, 3, dtype=torch.long)),
         r"hash_table must have shape \[vocab_size, top_k\]"),
        (dict(routing="deepseek_v4_hash", num_experts=8, top_k=2, hash_table=torch.zeros(4, 2)),
         "hash_table must be an integer tensor"),
        (dict(routing="deepseek_v4_hash", num_experts=8, top_k=2, hash_table=torch.full((4, 2), 8)),
         r"hash_table holds expert ids in \[8, 8\]"),
        (dict(routing="longcat_flash", num_experts=8, top_k=2, num_zero_experts=-1), "num_zero_experts must be an int"),
        (dict(routing="longcat_flash", num_experts=8, top_k=2, num_zero_experts=2, correction_bias=torch.zeros(8)),
         r"correction_bias must have shape \[num_experts\] = \(10,\)"),
    ],
)
def test_router_rejects(kwargs, message):
    with pytest.raises(MoEConfigError, match=message):
        Router(**kwargs)


HASH = Router("deepseek_v4_hash", 4, 2, hash_table=torch.tensor([[0, 1], [2, 3], [1, 2]]))


@pytest.mark.parametrize(
    "input_ids, message",
    [
        (None, "pass input_ids"),
        (torch.tensor([[0, 1]]), r"input_ids must be an integer tensor \[M\] = \[2\].*got shape \[1, 2\]"),
        (torch.tensor([0.0, 1.0]), "got dtype torch.float32"),
        (torch.tensor([0, 3]), r"input_ids holds token ids in \[0, 3\]; the hash_table covers \[0, 3\)"),
        (torch.tensor([-1, 0]), r"token ids in \[-1, 0\]"),
        ([0, 1], "got list"),
    ],
)
def test_hash_router_rejects_bad_input_ids(input_ids, message):
    with pytest.raises(MoEConfigError, match=message):
        HASH(torch.zeros(2, 4), input_ids)


def test_zero_experts_widen_the_logits():
    with pytest.raises(MoEConfigError, match="num_experts=8 \\+ num_zero_experts=4"):
        Router("longcat_flash", 8, 2, num_zero_experts=4)(torch.zeros(3, 8))


def test_other_kinds_shape_check_input_ids_but_do_not_need_them():
    router = Router("softmax", 4, 2)
    assert router(torch.zeros(2, 4), torch.tensor([7, 9])).ids.tolist() == [[0, 1]] * 2
    with pytest.raises(MoEConfigError, match="input_ids must be"):
        router(torch.zeros(2, 4), torch.tensor([7]))


# ----------------------------------------------------------------------------------------------
# The layer


def test_fold_zero_experts():
    from moe.router import TopK

    topk = TopK(torch.tensor([[5, 2], [4, 5], [1, 0]], dtype=torch.int32), torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]]))
    hidden = torch.arange(6.0).view(3, 2)
    folded, shared = fold_zero_experts(topk, hidden, num_experts=4, shared_output=torch.ones(3, 2))
    assert folded.ids.tolist() == [[2, 2], [0, 0], [1, 0]]  # zero slots -> the token's own real expert, else 0
    assert folded.weights.tolist() == [[0.0, 0.25], [0.0, 0.0], [3.0, 4.0]]
    torch.testing.assert_close(shared, torch.tensor([[1.0, 1.5], [7.0, 10.0], [1.0, 1.0]]))


def _layer(routing: str, num_experts: int, top_k: int, **options) -> FusedMoE:
    return FusedMoE(num_experts, top_k, H, I, dtype=torch.float32, quant="fp32", routing=routing, **options)


def test_layer_with_zero_experts_matches_transformers_longcat_block():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashConfig, LongcatFlashMoE

    config = LongcatFlashConfig(hidden_size=H, n_routed_experts=8, zero_expert_num=4, moe_topk=3,
                                expert_ffn_hidden_size=I, routed_scaling_factor=6.0)
    block = LongcatFlashMoE(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in (block.experts.gate_up_proj, block.experts.down_proj, block.router.classifier.weight):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) / 4)
        block.router.e_score_correction_bias.copy_(torch.randn(12, generator=generator) * 0.01)
        hidden = torch.randn(33, H, generator=generator)
        expected = block(hidden.view(1, 33, H)).view(33, H)
        logits = torch.nn.functional.linear(hidden, block.router.classifier.weight)
        layer = _layer("longcat_flash", 8, 3, num_zero_experts=4, routed_scaling_factor=6.0,
                       correction_bias=block.router.e_score_correction_bias.clone())
        layer.load_weights(w13=block.experts.gate_up_proj[:8].clone(), w2=block.experts.down_proj.clone())
        assert bool((layer.router(logits).ids >= 8).any())  # some slots do go to zero experts
        torch.testing.assert_close(layer(hidden, logits), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(MoEConfigError, match=r"router_logits must be \[M, num_experts \+ num_zero_experts\] = \[33, 12\]"):
        layer(hidden, logits[:, :8])


def test_layer_applies_llama4_weight_to_the_input_as_transformers_does():
    pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4TextConfig, Llama4TextMoe

    config = Llama4TextConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=1, intermediate_size=I,
                              intermediate_size_mlp=I)
    block = Llama4TextMoe(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in block.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) / 2)
        hidden = torch.randn(17, H, generator=generator)
        expected, logits = block(hidden)
        layer = _layer("llama4", 8, 1)
        layer.load_weights(w13=block.experts.gate_up_proj.transpose(1, 2).contiguous(),
                           w2=block.experts.down_proj.transpose(1, 2).contiguous())
        out = layer(hidden, logits, shared_output=block.shared_expert(hidden))
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        # the weight on the output instead gives another result: the comparison above can tell them apart
        on_output = layer.kernel.forward(hidden, layer.router(logits)) + block.shared_expert(hidden)
        assert not torch.allclose(on_output, expected, rtol=1e-2, atol=1e-3)


def test_llama4_layer_refuses_top_k_above_one():
    with pytest.raises(MoEConfigError, match="routing='llama4' multiplies each expert's input .* top_k=1 only"):
        _layer("llama4", 8, 2)


def test_layer_hash_routing_needs_input_ids():
    table = torch.randint(0, 8, (50, 2), generator=torch.Generator().manual_seed(2))
    layer = _layer("deepseek_v4_hash", 8, 2, hash_table=table)
    layer.load_weights(w13=torch.randn(8, 2 * I, H) / 4, w2=torch.randn(8, H, I) / 4)
    hidden, logits, ids = torch.randn(5, H), torch.randn(5, 8), torch.tensor([0, 49, 3, 3, 7])
    topk = layer.router(logits, ids)
    assert topk.ids.tolist() == table[ids].tolist()
    torch.testing.assert_close(layer(hidden, logits, input_ids=ids), layer.kernel.forward(hidden, topk))
    with pytest.raises(MoEConfigError, match="pass input_ids"):
        layer(hidden, logits)
    with pytest.raises(MoEConfigError, match=r"token ids in \[0, 50\]"):
        layer(hidden, logits, input_ids=torch.tensor([0, 50, 1, 1, 1]))


def test_hash_routing_compiles_with_its_token_ids(fresh_dynamo):
    """input_ids travel through the layer's custom op (moe::fused_moe) like the logits: compiled == eager."""
    table = torch.randint(0, 8, (50, 2), generator=torch.Generator().manual_seed(3))
    layer = _layer("deepseek_v4_hash", 8, 2, hash_table=table)
    layer.load_weights(w13=torch.randn(8, 2 * I, H) / 4, w2=torch.randn(8, H, I) / 4)
    hidden, logits, ids = torch.randn(5, H), torch.randn(5, 8), torch.tensor([0, 49, 3, 3, 7])
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(hidden, logits, input_ids=ids), layer(hidden, logits, input_ids=ids),
                               rtol=0, atol=0)


def test_zero_experts_with_shared_experts_add_both():
    """A layer with zero experts and its own shared experts: the output is the routed experts, plus the
    zero experts' weight * hidden, plus the shared MLP, each once."""
    from moe.shared import SharedExperts

    w_gate, w_up, w_down = torch.randn(I, H) / 4, torch.randn(I, H) / 4, torch.randn(H, I) / 4
    shared = SharedExperts(H, I, dtype=torch.float32)
    shared.load_weights(w13=torch.cat([w_gate, w_up]), w2=w_down)
    layer = FusedMoE(6, 3, H, I, dtype=torch.float32, quant="fp32", routing="longcat_flash",
                     num_zero_experts=2, shared_experts=shared)
    plain = _layer("longcat_flash", 6, 3, num_zero_experts=2)
    weights = dict(w13=torch.randn(6, 2 * I, H) / 4, w2=torch.randn(6, H, I) / 4)
    layer.load_weights(**weights)
    plain.load_weights(**weights)
    hidden, logits = torch.randn(9, H), torch.randn(9, 8) * 3
    assert bool((layer.router(logits).ids >= 6).any())
    dense = torch.nn.functional.silu(hidden @ w_gate.T) * (hidden @ w_up.T) @ w_down.T
    torch.testing.assert_close(layer(hidden, logits), plain(hidden, logits) + dense, rtol=1e-5, atol=1e-5)
