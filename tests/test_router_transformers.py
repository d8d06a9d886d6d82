"""Every routing kind against transformers' own router module, built from a tiny config (no download).

Each case builds the model's router with random weights, runs it on random hidden states, and runs
our `Router` on the logits it computed. Two inputs per case:

- random weights (no ties): the same experts with the same weights, compared as dense ``[M, E]`` maps
  (transformers' ``topk(sorted=False)`` returns the k in any order);
- tied weights (pairs of experts, or whole groups, with identical router rows and bias): which of two
  identical experts transformers picks is unspecified, so each row's chosen selection keys and
  weights are compared as multisets, and ours must pick the lower ids among equals.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe.router import Router, TopK  # noqa: E402

H, M = 16, 33


def _dense(ids: torch.Tensor, weights: torch.Tensor, width: int) -> torch.Tensor:
    return torch.zeros(ids.shape[0], width).scatter_(1, ids.long(), weights.float())


def _tie(weight: torch.Tensor, bias: torch.Tensor | None, pairs) -> None:
    for source, copy in pairs:
        weight.data[copy] = weight.data[source]
        if bias is not None:
            bias.data[copy] = bias.data[source]


def _check(ours: TopK, hf_ids: torch.Tensor, hf_weights: torch.Tensor, key: torch.Tensor, tied: bool) -> None:
    width = key.shape[1]
    ours_dense, hf_dense = _dense(ours.ids, ours.weights, width), _dense(hf_ids, hf_weights, width)
    if not tied:
        torch.testing.assert_close(ours_dense, hf_dense, rtol=1e-6, atol=1e-7)
        return
    ours_keys = key.gather(1, ours.ids.long()).sort(dim=1).values
    hf_keys = key.gather(1, hf_ids.long()).sort(dim=1).values
    assert torch.equal(ours_keys, hf_keys), "the chosen experts differ beyond ties"
    torch.testing.assert_close(ours.weights.sort(dim=1).values, hf_weights.float().sort(dim=1).values,
                               rtol=1e-6, atol=1e-7)
    boundary_ties = 0
    for row_ids, row_key in zip(ours.ids.tolist(), key.tolist()):  # among equals, the lower id
        for expert in row_ids:
            left_out = [e for e, v in enumerate(row_key) if v == row_key[expert] and e not in row_ids]
            assert all(e > expert for e in left_out), (row_ids, expert, left_out)
            boundary_ties += bool(left_out)
    assert boundary_ties > 0, "no row has a tie across the top-k boundary: the case tests no tie-break"



def _hidden(seed: int) -> torch.Tensor:
    return torch.randn(M, H, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _randomize(module: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)


@pytest.mark.parametrize("tied", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("model, norm", [("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe", False),
                                         ("qwen3_moe", True), ("mixtral", True)])
def test_softmax_routers(model, norm, tied):
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeTopKRouter

    if model == "mixtral":
        module = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=3))
    else:
        config_cls, router_cls = {"qwen2_moe": (Qwen2MoeConfig, Qwen2MoeTopKRouter),
                                  "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeTopKRouter)}[model]
        module = router_cls(config_cls(hidden_size=H, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm))
    _randomize(module, 1)
    if tied:
        _tie(module.weight, None, [(0, 5), (2, 3)])
    logits, hf_weights, hf_ids = module(_hidden(2))
    ours = Router("softmax", 8, 3, renormalize=norm)(logits)
    _check(ours, hf_ids, hf_weights, torch.softmax(logits.float(), -1), tied)


def test_qwen_norm_topk_prob_off_is_renormalize_false():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeTopKRouter

    module = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=2,
                                               norm_topk_prob=False))
    _randomize(module, 3)
    logits, hf_weights, _ = module(_hidden(4))
    assert float(hf_weights.sum(-1).min()) < 0.9  # unnormalized: the two probabilities sum below 1
    torch.testing.assert_close(Router("softmax", 8, 2, renormalize=False)(logits).weights, hf_weights)
    assert not torch.allclose(Router("softmax", 8, 2)(logits).weights, hf_weights)  # the default renormalizes


@pytest.mark.parametrize("tied", [False, True], ids=["random", "ties"])
def test_gpt_oss_router(tied):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssTopKRouter

    module = GptOssTopKRouter(GptOssConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2))
    _randomize(module, 5)
    if tied:
        _tie(module.weight, module.bias, [(1, 6), (3, 4)])
    logits, hf_weights, hf_ids = module(_hidden(6))
    _check(Router("gpt_oss", 8, 2)(logits), hf_ids, hf_weights, logits, tied)


@pytest.mark.parametrize("tied", [False, True], ids=["random", "ties"])
def test_deepseek_v3_router(tied):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    module = DeepseekV3TopkRouter(config)
    _randomize(module, 7)
    module.e_score_correction_bias.mul_(0.1)
    if tied:  # group 1 a copy of group 0 (tied groups), and one tied pair inside group 2
        _tie(module.weight, module.e_score_correction_bias, [(0, 4), (1, 5), (2, 6), (3, 7), (8, 9)])
    logits, hf_weights, hf_ids = module(_hidden(8))
    bias = module.e_score_correction_bias
    ours = Router("deepseek_v3", 16, 4, n_group=4, topk_group=2, correction_bias=bias, routed_scaling_factor=2.5)
    _check(ours(logits), hf_ids, hf_weights, torch.sigmoid(logits) + bias, tied)


def _deepseek_v4_config():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, vocab_size=40,
                            num_hidden_layers=2)


@pytest.mark.parametrize("tied", [False, True], ids=["random", "ties"])
def test_deepseek_v4_router(tied):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    config = _deepseek_v4_config()
    assert config.scoring_func == "sqrtsoftplus"
    module = DeepseekV4TopKRouter(config)
    _randomize(module, 9)
    if tied:
        _tie(module.weight, module.e_score_correction_bias, [(0, 11), (5, 6)])
    logits, hf_weights, hf_ids = module(_hidden(10))
    bias = module.e_score_correction_bias
    ours = Router("deepseek_v4", 16, 4, correction_bias=bias, routed_scaling_factor=config.routed_scaling_factor)
    key = torch.nn.functional.softplus(logits).sqrt() + bias
    _check(ours(logits), hf_ids, hf_weights, key, tied)


def test_deepseek_v4_hash_router():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    config = _deepseek_v4_config()
    module = DeepseekV4HashRouter(config)
    _randomize(module, 11)
    generator = torch.Generator().manual_seed(12)
    module.tid2eid.copy_(torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(40)]))
    input_ids = torch.randint(0, 40, (M,), generator=generator)
    logits, hf_weights, hf_ids = module(_hidden(13), input_ids)
    ours = Router("deepseek_v4_hash", 16, 4, routed_scaling_factor=config.routed_scaling_factor,
                  hash_table=module.tid2eid)(logits, input_ids)
    assert ours.ids.tolist() == hf_ids.tolist()  # the table's order, slot for slot
    torch.testing.assert_close(ours.weights, hf_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tied", [False, True], ids=["random", "ties"])
def test_llama4_router(tied):
    from transformers.models.llama4.modeling_llama4 import Llama4Router, Llama4TextConfig

    module = Llama4Router(Llama4TextConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=1))
    _randomize(module, 14)
    if tied:
        _tie(module.weight, None, [(2, 7), (0, 1)])
    hf_scores, logits = module(_hidden(15))  # scores: [M, E], sigmoid of the chosen logit, 0 elsewhere
    hf_weights, hf_ids = hf_scores.max(dim=1, keepdim=True)
    _check(Router("llama4", 8, 1)(logits), hf_ids, hf_weights, logits, tied)


@pytest.mark.parametrize("tied", [False, True], ids=["random", "ties"])
def test_longcat_flash_router_with_zero_experts(tied):
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashConfig, LongcatFlashTopkRouter

    config = LongcatFlashConfig(hidden_size=H, n_routed_experts=8, zero_expert_num=4, moe_topk=3,
                                routed_scaling_factor=6.0)
    module = LongcatFlashTopkRouter(config)
    _randomize(module, 16)
    module.e_score_correction_bias.mul_(0.01)
    if tied:  # a real expert tied with a zero expert, and two zero experts tied
        _tie(module.classifier.weight, module.e_score_correction_bias, [(3, 9), (10, 11)])
    logits, hf_weights, hf_ids = module(_hidden(17))
    bias = module.e_score_correction_bias
    ours = Router("longcat_flash", 8, 3, num_zero_experts=4, correction_bias=bias, routed_scaling_factor=6.0)
    topk = ours(logits)
    assert bool((topk.ids >= 8).any()), "the case should route some slots to zero experts"
    _check(topk, hf_ids, hf_weights, torch.softmax(logits, -1) + bias, tied)
