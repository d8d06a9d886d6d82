"""moe.integrations.transformers on tiny random transformers models of each family (built from their config
classes: no downloads): the patched model against transformers' own eager experts, fallbacks, re-preparing,
memory, and save_pretrained -> moe.loaders round trips."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import moe  # noqa: E402
import moe.integrations.transformers as moe_hf  # noqa: E402
from moe.integrations._binding import ExpertsFallbackWarning  # noqa: E402
from moe.loaders import load_experts  # noqa: E402
from moe.tolerance import TOLERANCES, relative_error  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64, tie_word_embeddings=False)


def config(family: str):
    t = transformers
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[])
    if family == "mixtral":
        return t.MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    if family == "gpt_oss":
        return t.GptOssConfig(**COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                              head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    if family == "deepseek_v3":
        return t.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 2}, intermediate_size=48,
                                  moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                  topk_group=1, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    if family == "deepseek_v4":  # swiglu_limit small enough that the clamp bites
        return t.DeepseekV4Config(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, head_dim=16, q_lora_rank=8, num_experts_per_tok=2,
                                  n_routed_experts=4, layer_types=["sliding_attention", "compressed_sparse_attention"],
                                  mlp_layer_types=["moe", "moe"], o_groups=1, o_lora_rank=8, index_n_heads=2,
                                  index_head_dim=8, index_topk=4, qk_rope_head_dim=8, sliding_window=8,
                                  num_nextn_predict_layers=0, max_position_embeddings=64, hc_mult=1, swiglu_limit=0.5)
    assert family == "nemotron_h"  # a latent MoE: the experts see moe_latent_size, not hidden_size
    return t.NemotronHConfig(vocab_size=64, hidden_size=32, layers_block_type=["moe", "full_attention"],
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             moe_shared_expert_intermediate_size=16, moe_latent_size=24, mtp_layers_block_type=[],
                             num_nextn_predict_layers=0)


FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "deepseek_v4", "nemotron_h")
# what save_pretrained writes for layer 0's experts: (moe.loaders layout, key prefix)
SAVED = {"qwen3_moe": ("qwen3", "model.layers.0.mlp."), "mixtral": ("mixtral", "model.layers.0.block_sparse_moe."),
         "gpt_oss": ("gpt_oss", "model.layers.0.mlp."), "deepseek_v3": ("deepseek", "model.layers.0.mlp."),
         "deepseek_v4": ("mixtral", "model.layers.0.ffn."), "nemotron_h": ("nemotron_h", "backbone.layers.0.mixer.")}


def tiny_model(family: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(family)).to(dtype).eval()
    with torch.no_grad():  # biases and the V4 correction terms start at zero; make them count
        for name, param in model.named_parameters():
            if name.endswith("_bias") or "experts" in name:
                param.normal_(0, 0.5)
    return model


def experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def eager_logits(model, ids):
    model.set_experts_implementation("eager")
    with torch.no_grad():
        return model(ids).logits


def moe_logits(model, ids):
    model.set_experts_implementation("moe")
    with torch.no_grad():
        return model(ids).logits


def prompt(seed=1, batch=2, length=7):
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_eager_in_float32(family):
    model = tiny_model(family)
    ids = prompt()
    expected = eager_logits(model, ids)
    report = moe_hf.use_moe(model)
    assert len(report) == len(experts_modules(model)) >= 1
    assert all("fallback" not in served for served in report.values()), report
    assert relative_error(moe_logits(model, ids), expected) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_eager_in_bf16(family):
    model = tiny_model(family, torch.bfloat16)
    ids = prompt()
    expected = eager_logits(model, ids)
    moe_hf.use_moe(model)
    assert relative_error(moe_logits(model, ids), expected) <= TOLERANCES["bf16"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_gives_the_same_tokens(family):
    model = tiny_model(family)
    ids = prompt(batch=1, length=4)
    options = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    model.set_experts_implementation("eager")
    expected = model.generate(ids, **options)
    moe_hf.use_moe(model)
    assert expected.shape[1] == 20
    assert torch.equal(model.generate(ids, **options), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_stays_within_five_percent_of_eager(family):
    model = tiny_model(family, torch.bfloat16)
    eager = moe_hf.memory_bytes(model)["model"]
    moe_hf.use_moe(model)
    patched = moe_hf.memory_bytes(model)
    print(f"{family}: eager {eager} B, patched {patched['model']} + {patched['moe']} B (+ workspace {patched['workspace']} B)")
    assert patched["model"] + patched["moe"] <= 1.05 * eager
    in_place = family != "gpt_oss"  # only GPT-OSS's transposed, interleaved layout needs a converted copy
    assert (patched["model"] == eager) is in_place


def test_from_pretrained_with_experts_implementation_moe(tmp_path):
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="moe").eval()
    assert model.config._experts_implementation == "moe"
    ids = prompt()
    got = moe_logits(model, ids)  # prepared lazily, at this first forward
    bindings = [m.__dict__.get("_moe_binding") for _, m in experts_modules(model)]
    assert all(b is not None and b.layer is not None for b in bindings)
    assert relative_error(got, eager_logits(model, ids)) <= 1e-4


def fallback_warnings(model, ids, times=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [moe_logits(model, ids) for _ in range(times)]
    return outs[-1], [w for w in caught if issubclass(w.category, ExpertsFallbackWarning)]


def test_unknown_activation_falls_back_with_one_warning_per_module():
    model = tiny_model("mixtral")
    for _, module in experts_modules(model):
        module.act_fn = torch.nn.Tanh()  # gated tanh: not one moe computes
    ids = prompt()
    expected = eager_logits(model, ids)
    report = moe_hf.use_moe(model)
    assert all(served.startswith("fallback: its activation Tanh") for served in report.values()), report
    got, caught = fallback_warnings(model, ids)
    assert caught == []  # use_moe warned already; forwards do not warn again
    assert relative_error(got, expected) <= 1e-6


def test_expert_parallel_module_falls_back_and_names_itself():
    model = tiny_model("qwen3_moe")
    ids = prompt()
    expected = eager_logits(model, ids)
    moe_hf.use_moe(model)
    name, module = experts_modules(model)[0]
    module._is_expert_parallel = True
    got, caught = fallback_warnings(model, ids, times=3)
    assert len(caught) == 1
    assert name in str(caught[0].message) and "expert parallel" in str(caught[0].message)
    assert relative_error(got, expected) <= 1e-4


def test_a_backend_that_cannot_serve_falls_back_with_its_reasons():
    model = tiny_model("qwen3_moe")
    ids = prompt()
    expected = eager_logits(model, ids)
    with pytest.warns(ExpertsFallbackWarning, match="moe cannot serve it: .*flashinfer_cutlass"):
        report = moe_hf.use_moe(model, experts="flashinfer_cutlass")
    assert all(served.startswith("fallback: moe cannot serve it") for served in report.values())
    assert relative_error(moe_logits(model, ids), expected) <= 1e-6


def test_post_expert_norm_and_quantized_weights_are_reasons_to_fall_back():
    _, module = experts_modules(tiny_model("qwen3_moe"))[0]
    assert moe_hf._read(module).layout == "transformers_fused"
    module.has_post_expert_norm = True
    assert "has_post_expert_norm=True" in moe_hf._read(module)
    module.has_post_expert_norm = False
    module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False)
    assert "moe serves bf16, fp16 and fp32 modules" in moe_hf._read(module)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # in place, and released
def test_new_parameters_are_prepared_again(family):
    model = tiny_model(family)
    ids = prompt()
    moe_hf.use_moe(model)
    before = moe_logits(model, ids)
    _, module = experts_modules(model)[0]
    fresh = torch.randn(module.down_proj.shape, generator=torch.Generator().manual_seed(5))
    module.down_proj = torch.nn.Parameter(fresh)  # a new parameter (the others stay, or come back)
    after = moe_logits(model, ids)
    with torch.no_grad():
        module.down_proj.mul_(-1)  # in place, seen through the version counter
    if family == "gpt_oss":  # released again: its values live in the layer, so a write into it is refused
        with pytest.raises(moe.MoEConfigError, match="written in place, but moe released them"):
            moe_logits(model, ids)
        moe_hf.unuse_moe(model, "eager")
        assert relative_error(after, eager_logits(model, ids)) <= 1e-4
        return
    negated = moe_logits(model, ids)
    moe_hf.unuse_moe(model, "eager")  # gives released parameters back
    assert relative_error(after, before) > 1e-2 and relative_error(negated, after) > 1e-2
    assert relative_error(negated, eager_logits(model, ids)) <= 1e-4
    with torch.no_grad():
        module.down_proj.mul_(-1)
    assert relative_error(after, eager_logits(model, ids)) <= 1e-4


def test_released_parameters_come_back_through_state_dict_and_load_state_dict():
    model, other = tiny_model("gpt_oss"), tiny_model("gpt_oss", seed=3)
    originals = {k: v.clone() for k, v in model.state_dict().items()}
    moe_hf.use_moe(model)
    _, module = experts_modules(model)[0]
    assert module.gate_up_proj.device.type == "meta"  # released: the layer holds the converted copy
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in originals.items())
    ids = prompt()
    with pytest.raises(RuntimeError, match="meta"):  # another implementation needs the parameters back first
        eager_logits(model, ids)
    model.load_state_dict(other.state_dict())  # real parameters again, then loaded; prepared at the next forward
    assert relative_error(moe_logits(model, ids), eager_logits(other, ids)) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trips_through_the_loaders(family, tmp_path):
    model = tiny_model(family)
    moe_hf.use_moe(model)
    model.save_pretrained(tmp_path)  # while patched: released parameters are written back from the layers
    in_memory = model.state_dict()
    moe_hf.unuse_moe(model, "eager")
    saved = safetensors_torch.load_file(tmp_path / "model.safetensors")
    layout, prefix = SAVED[family]
    name, module = experts_modules(model)[0]
    _check_loaded(module, saved, layout, prefix)
    memory_layout = "transformers_fused_transposed" if family == "gpt_oss" else "transformers_fused"
    _check_loaded(module, in_memory, memory_layout, name.removesuffix("experts"))


def _check_loaded(module, tensors, layout, prefix):
    """A FusedMoE loaded from ``tensors`` computes what the module's own eager forward does."""
    weights = load_experts(tensors, layout, num_experts=4, prefix=prefix)
    activation = moe_hf._read(module).activation
    layer = moe.FusedMoE(4, 2, weights.hidden_size, weights.intermediate_size, activation=activation,
                         quant="fp32", dtype=torch.float32, has_bias=weights.has_bias)
    layer.load_checkpoint(tensors, layout, prefix=prefix)
    x = torch.randn(6, weights.hidden_size, generator=torch.Generator().manual_seed(2))
    ids = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t))[:2] for t in range(6)])
    topk_weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = moe_hf._own_forward(module)(module, x, ids, topk_weights)
    assert relative_error(layer(x, topk_ids=ids, topk_weights=topk_weights), expected) <= 1e-5


def test_the_example_runs_and_matches_eager():
    done = subprocess.run([sys.executable, "examples/transformers_generate.py", "--tokens", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tokens match eager: True" in done.stdout


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_torch_compile_of_a_patched_model_matches_eager(family):
    model = tiny_model(family)
    ids = prompt()
    expected = eager_logits(model, ids)
    moe_hf.use_moe(model)  # prepared before compiling: the compiled forward reaches the layers through moe::fused_moe
    graphs = []

    def keep_graphs(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    with torch.no_grad():
        whole = torch.compile(model, backend=keep_graphs, fullgraph=True)(ids).logits
        torch._dynamo.reset()
        through_aot = torch.compile(model, backend="aot_eager")(ids).logits  # functionalization, as inductor does
    calls = [node for node in graphs[0].graph.nodes if node.target is torch.ops.moe.fused_moe.default]
    assert len(graphs) == 1 and len(calls) == len(experts_modules(model)) == 2  # one op per MoE layer, one graph
    assert relative_error(whole, expected) <= 1e-4
    assert relative_error(through_aot, expected) <= 1e-4
