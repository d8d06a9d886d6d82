"""Shared experts owned by the layer (moe/shared.py, moe/shared_loaders.py): the math against a hand loop
and against ``shared_output=``, the checkpoint loaders against transformers' own modules, bad input, and
the oracle's and ``moe plan``'s estimate of the layer with them."""

from __future__ import annotations

import json

import pytest
import torch

from moe import FusedMoE, MoEConfigError, Platform, SharedExperts, SharedExpertsConfig, UnsupportedError
from moe.activation import Activation
from moe.oracle import plan
from moe.oracle.cost import SHARED_OVERLAP_MAX_TOKENS, STREAM_FORK_JOIN_US
from moe.presets import load_preset
from moe.problem import MoEProblem
from moe.tools.cli import main as cli_main

E, K, H, I, SHARED_I = 8, 2, 64, 32, 48
SCALE = 2.5  # routed_scaling_factor: applied once, by the Router, to the top-k weights

# (activation, sigmoid gate): DeepSeek-style gated, Nemotron-H's non-gated relu2, Qwen2-MoE's gated + sigmoid gate
KINDS = [("silu", False), ("relu2", False), ("silu", True)]
KIND_IDS = ["gated", "relu2", "sigmoid_gated"]


def _weights(activation: str, sigmoid_gate: bool):
    rows = Activation.parse(activation).w13_rows
    routed = dict(w13=torch.randn(E, rows(I), H) / 8, w2=torch.randn(E, H, I) / 8)
    shared = dict(w13=torch.randn(rows(SHARED_I), H) / 8, w2=torch.randn(H, SHARED_I) / 8)
    if sigmoid_gate:
        shared["gate"] = torch.randn(1, H) / 8
    return routed, shared


def _layer(activation: str, shared=None) -> FusedMoE:
    return FusedMoE(E, K, H, I, activation=activation, dtype=torch.float32, quant="fp32", renormalize=True,
                    routed_scaling_factor=SCALE, shared_experts=shared)


def _hand_loop(x, logits, routed, shared, activation):
    """The whole layer token by token: softmax top-k, renormalized, times SCALE; plus the shared MLP."""
    act = Activation.parse(activation)
    out = torch.zeros_like(x)
    for m in range(x.shape[0]):
        probs = torch.softmax(logits[m].float(), dim=-1)
        values, ids = probs.topk(K)
        for w, e in zip(values / values.sum() * SCALE, ids.tolist()):
            out[m] += w * (routed["w2"][e] @ act(routed["w13"][e] @ x[m]))
        dense = shared["w2"] @ act(shared["w13"] @ x[m])
        if "gate" in shared:
            dense = dense * torch.sigmoid(shared["gate"][0] @ x[m])
        out[m] += dense
    return out


@pytest.mark.parametrize("activation,sigmoid_gate", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("tokens", [0, 1, 7])
def test_layer_with_shared_experts_equals_shared_output_and_the_hand_loop(activation, sigmoid_gate, tokens):
    routed, shared_weights = _weights(activation, sigmoid_gate)
    layer = _layer(activation, SharedExpertsConfig(SHARED_I, sigmoid_gate=sigmoid_gate))
    layer.load_weights(**routed)
    layer.shared_experts.load_weights(**shared_weights)
    plain = _layer(activation)
    plain.load_weights(**routed)
    x, logits = torch.randn(tokens, H), torch.randn(tokens, E)

    out = layer(x, logits)
    dense = layer.shared_experts(x)
    assert torch.equal(out, plain(x, logits, shared_output=dense))  # the same finalize adds it, bit for bit
    torch.testing.assert_close(out, _hand_loop(x, logits, routed, shared_weights, activation), rtol=1e-5, atol=1e-5)
    if tokens:
        assert not torch.allclose(out, plain(x, logits), atol=1e-3)  # the shared part is really there


def test_shared_experts_module_built_outside_the_layer_and_precomputed_routing():
    routed, shared_weights = _weights("silu", False)
    shared = SharedExperts(H, SHARED_I, dtype=torch.float32)
    shared.load_weights(**shared_weights)
    layer = _layer("silu", shared)
    layer.load_weights(**routed)
    assert layer.shared_experts is shared and "shared_experts" in dict(layer.named_children())
    x, logits = torch.randn(5, H), torch.randn(5, E)
    topk = layer.router(logits)
    want = _hand_loop(x, logits, routed, shared_weights, "silu")
    torch.testing.assert_close(layer(x, topk_ids=topk.ids, topk_weights=topk.weights), want, rtol=1e-5, atol=1e-5)


# --- bad input ----------------------------------------------------------------------------------------
def _loaded_layer():
    routed, shared_weights = _weights("silu", False)
    layer = _layer("silu", SharedExpertsConfig(SHARED_I))
    layer.load_weights(**routed)
    layer.shared_experts.load_weights(**shared_weights)
    return layer


def test_shared_experts_and_shared_output_together_is_an_error():
    layer = _loaded_layer()
    x = torch.randn(3, H)
    with pytest.raises(MoEConfigError, match="shared_output: this layer computes its own shared experts"):
        layer(x, torch.randn(3, E), shared_output=torch.zeros(3, H))


@pytest.mark.parametrize("given,match", [
    (SharedExperts(32, SHARED_I, dtype=torch.float32), r"shared_experts has H=32.*the layer has H=64"),
    (SharedExperts(H, SHARED_I, dtype=torch.bfloat16), r"dtype torch.bfloat16.*dtype torch.float32"),
    (2048, r"shared_experts must be a moe.SharedExperts, a moe.SharedExpertsConfig or None \(got int\)"),
], ids=["hidden_size", "dtype", "type"])
def test_shared_experts_that_do_not_fit_the_layer(given, match):
    with pytest.raises(MoEConfigError, match=match):
        _layer("silu", given)


def test_unloaded_shared_experts_and_bad_weights():
    layer = _layer("silu", SharedExpertsConfig(SHARED_I))
    layer.load_weights(**_weights("silu", False)[0])
    with pytest.raises(MoEConfigError, match="SharedExperts has no weights"):
        layer(torch.randn(2, H), torch.randn(2, E))
    shared = layer.shared_experts
    with pytest.raises(MoEConfigError, match=r"w13 must be \[2I, H\] rows \[gate; up\] = \[96, 64\].*got \[48, 64\]"):
        shared.load_weights(w13=torch.randn(SHARED_I, H), w2=torch.randn(H, SHARED_I))
    with pytest.raises(MoEConfigError, match="gate: given, but these shared experts were built with sigmoid_gate=False"):
        shared.load_weights(w13=torch.randn(2 * SHARED_I, H), w2=torch.randn(H, SHARED_I), gate=torch.randn(1, H))
    with pytest.raises(MoEConfigError, match="w2 contains NaN"):
        shared.load_weights(w13=torch.randn(2 * SHARED_I, H), w2=torch.full((H, SHARED_I), float("nan")))
    with pytest.raises(MoEConfigError, match="intermediate_size must be a positive int"):
        SharedExpertsConfig(0)


def test_checkpoint_errors_name_the_key_and_the_layout():
    shared = SharedExperts(H, SHARED_I, dtype=torch.float32)
    tensors = {"mlp.shared_experts.up_proj.weight": torch.randn(SHARED_I, H)}
    with pytest.raises(MoEConfigError, match="missing key 'mlp.shared_experts.down_proj.weight'"):
        shared.load_checkpoint(tensors, "deepseek", prefix="mlp.")
    with pytest.raises(MoEConfigError, match="unknown shared-expert layout 'mixtral'"):
        shared.load_checkpoint(tensors, "mixtral")
    with pytest.raises(MoEConfigError, match="'nemotron_h' stores a non-gated shared MLP"):
        shared.load_checkpoint(tensors, "nemotron_h")
    with pytest.raises(MoEConfigError, match=r"'qwen2_moe' has a sigmoid gate.*sigmoid_gate=True"):
        shared.load_checkpoint(tensors, "qwen2_moe")
    tensors = {f"shared_experts.{n}.weight": torch.randn(SHARED_I, H) for n in ("gate_proj", "up_proj")}
    tensors["shared_experts.down_proj.weight"] = torch.randn(SHARED_I, H)  # transposed
    with pytest.raises(MoEConfigError, match=r"'shared_experts.down_proj.weight': expected shape \[H, I\] = \(64, 48\)"):
        shared.load_checkpoint(tensors, "deepseek")
    tensors["shared_experts.up_proj.bias"] = torch.zeros(SHARED_I)
    with pytest.raises(UnsupportedError, match="shared experts with biases are not supported"):
        shared.load_checkpoint(tensors, "deepseek")


def test_layer_load_checkpoint_reads_the_shared_keys_of_its_layout():
    routed, shared_weights = _weights("silu", True)
    tensors = {}
    for e in range(E):
        tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"] = routed["w13"][e].chunk(2)
        tensors[f"mlp.experts.{e}.down_proj.weight"] = routed["w2"][e]
    gate, up = shared_weights["w13"].chunk(2)
    tensors.update({"mlp.shared_expert.gate_proj.weight": gate, "mlp.shared_expert.up_proj.weight": up,
                    "mlp.shared_expert.down_proj.weight": shared_weights["w2"],
                    "mlp.shared_expert_gate.weight": shared_weights["gate"]})
    layer = _layer("silu", SharedExpertsConfig(SHARED_I, sigmoid_gate=True))
    layer.load_checkpoint(tensors, "qwen3", prefix="mlp.")  # qwen3's routed keys go with qwen2_moe's shared ones
    x, logits = torch.randn(4, H), torch.randn(4, E)
    torch.testing.assert_close(layer(x, logits), _hand_loop(x, logits, routed, shared_weights, "silu"),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(MoEConfigError, match="'mixtral' layout has no shared experts of its own; pass shared_layout="):
        layer.load_checkpoint(tensors, "mixtral", prefix="mlp.")
    plain = _layer("silu")
    with pytest.raises(MoEConfigError, match="shared_layout='deepseek' but this layer has no shared experts"):
        plain.load_checkpoint(tensors, "qwen3", prefix="mlp.", shared_layout="deepseek")


# --- loaders against transformers' own modules ----------------------------------------------------
def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer random (finite), then the routed experts zeroed: the block's forward is
    then its shared part alone, computed by transformers' own code."""
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor) / 4)
        for name, tensor in module.named_parameters():
            if name.startswith("experts."):
                tensor.zero_()
    return module.eval()


def _deepseek_v3():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    config = m.DeepseekV3Config(hidden_size=H, moe_intermediate_size=24, n_shared_experts=2, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1, num_hidden_layers=1, vocab_size=32)
    return m.DeepseekV3MoE(config), SharedExperts(H, 48, dtype=torch.float32), "deepseek", lambda out: out


def _deepseek_v4():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    config = m.DeepseekV4Config(hidden_size=H, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                                num_hidden_layers=2, vocab_size=32, swiglu_limit=0.5, mlp_layer_types=["moe", "moe"])
    clamped_silu = Activation.parse("swiglu_oai", alpha=1.0, beta=0.0, limit=0.5)
    return (m.DeepseekV4SparseMoeBlock(config, 0), SharedExperts(H, 24, activation=clamped_silu, dtype=torch.float32),
            "deepseek", lambda out: out)


def _qwen2_moe():
    from transformers.models.qwen2_moe import modeling_qwen2_moe as m

    config = m.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=16, shared_expert_intermediate_size=40,
                              num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, vocab_size=32)
    return (m.Qwen2MoeSparseMoeBlock(config), SharedExperts(H, 40, sigmoid_gate=True, dtype=torch.float32),
            "qwen2_moe", lambda out: out)


def _nemotron_h():
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    config = m.NemotronHConfig(hidden_size=H, moe_intermediate_size=16, moe_shared_expert_intermediate_size=40,
                               n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                               layers_block_type=["moe"], vocab_size=32)
    return m.NemotronHMoE(config), SharedExperts(H, 40, activation="relu2", dtype=torch.float32), "nemotron_h", \
        lambda out: out


def _llama4():
    from transformers.models.llama4 import modeling_llama4 as m

    config = m.Llama4TextConfig(hidden_size=H, intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4,
                                num_experts_per_tok=1, num_hidden_layers=1, vocab_size=32)
    return m.Llama4TextMoe(config), SharedExperts(H, 24, dtype=torch.float32), "llama4", lambda out: out[0]


@pytest.mark.parametrize("model", [_deepseek_v3, _deepseek_v4, _qwen2_moe, _nemotron_h, _llama4],
                         ids=["deepseek_v3", "deepseek_v4", "qwen2_moe", "nemotron_h", "llama4"])
def test_loader_matches_the_transformers_module(model):
    pytest.importorskip("transformers")
    block, shared, layout, output = model()
    block = _randomized(block)
    prefix = "model.layers.0.mlp."
    tensors = {prefix + key: value for key, value in block.state_dict().items()}
    shared.load_checkpoint(tensors, layout, prefix=prefix)
    x = torch.randn(1, 5, H)
    with torch.no_grad():
        want = output(block(x)).reshape(5, H)
    assert want.abs().max() > 0.05  # the shared part is not ~0 (else any loader would pass)
    torch.testing.assert_close(shared(x.reshape(5, H)), want, rtol=1e-5, atol=1e-5)


# --- the oracle and `moe plan` -------------------------------------------------------------------------
def test_plan_overlaps_shared_experts_on_a_gpu_at_decode_and_adds_them_otherwise():
    problem = load_preset("deepseek-v3-ep8-slice").problem(max_tokens=4096)
    shared = SharedExpertsConfig(2048).problem(problem)
    assert (shared.num_experts, shared.top_k, shared.intermediate_size, shared.quant_name) == (1, 1, 2048, "bf16")
    gpu = plan(problem, Platform.preset("h100"), shared=shared)
    alone = plan(problem, Platform.preset("h100"))
    for with_shared, without in zip(gpu.buckets, alone.buckets):
        assert with_shared.chosen == without.chosen  # the ranking is the routed part's
        routed, dense = with_shared.chosen.us, with_shared.shared.alone.us
        overlapped = with_shared.high <= SHARED_OVERLAP_MAX_TOKENS  # measured: overlap pays at decode only
        want = max(routed, dense) + STREAM_FORK_JOIN_US if overlapped else routed + dense
        assert dense > 0 and with_shared.layer_us == pytest.approx(want), with_shared.high
        assert without.shared is None and without.layer_us == without.chosen.us
    small = MoEProblem.create(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant="bf16", max_tokens=64)
    cpu = plan(small, Platform.preset("cpu"), shared=SharedExpertsConfig(SHARED_I).problem(small))
    for bucket in cpu.buckets:
        assert bucket.layer_us == pytest.approx(bucket.chosen.us + bucket.shared.alone.us)
    with pytest.raises(MoEConfigError, match="plan: shared must be a SharedExpertsConfig"):
        plan(small, Platform.preset("cpu"), shared=SharedExpertsConfig(SHARED_I))


def test_presets_carry_their_shared_experts():
    assert load_preset("deepseek-v3").shared_experts() == SharedExpertsConfig(2048)
    assert load_preset("deepseek-v3-ep8-slice").shared_experts() == SharedExpertsConfig(2048)
    assert load_preset("nemotron-h").shared_experts() == SharedExpertsConfig(3712)
    assert load_preset("mixtral-8x7b").shared_experts() is None
    assert load_preset("deepseek-v3").scaled(256, 128, 8).shared_intermediate_size == 128


def test_moe_plan_shows_the_shared_expert(capsys):
    assert cli_main(["plan", "--platform", "h100", "--preset", "deepseek-v3", "--tokens", "1", "64"]) == 0
    text = capsys.readouterr().out
    assert "shared     a dense MLP H=7168 I=2048 activation=silu, on a second CUDA stream" in text
    assert text.count(" -> layer ") == 2
    argv = ["plan", "--platform", "h100", "--experts", "8", "--top-k", "2", "--hidden", "256", "--intermediate",
            "128", "--tokens", "1", "64"]
    assert cli_main(argv + ["--shared-intermediate", "512", "--json"]) == 0
    buckets = json.loads(capsys.readouterr().out)["plan"]
    assert all(b["layer_us"] >= max(b["estimated_us"], b["shared_us"]) for b in buckets)
    assert cli_main(argv + ["--json"]) == 0
    assert all(b["shared_us"] is None and b["layer_us"] == b["estimated_us"]
               for b in json.loads(capsys.readouterr().out)["plan"])
    assert cli_main(argv) == 0
    assert "shared" not in capsys.readouterr().out
    assert cli_main(["plan", "--platform", "h100", "--preset", "deepseek-v3", "--shared-intermediate", "0"]) == 0
    assert " -> layer " not in capsys.readouterr().out
