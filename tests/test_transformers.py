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
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # for configs whose defaults lie beyond 64 tokens


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
    # a latent MoE: the experts see moe_latent_size, not hidden_size. Attention comes first, as a cache layer does in
    # the real models (Mamba there): transformers 5.25's DynamicCache asks layer 0 for the cached length, and the
    # placeholder it keeps for an MoE layer has none (AttributeError: 'DummyLayer' ... 'get_seq_length')
    if family == "nemotron_h":
        return t.NemotronHConfig(vocab_size=64, hidden_size=32, layers_block_type=["full_attention", "moe"],
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 moe_shared_expert_intermediate_size=16, moe_latent_size=24, mtp_layers_block_type=[],
                                 num_nextn_predict_layers=0)
    if family == "minicpm5_moe":  # new in transformers 5.25, as Kolibri 1.1 and Ergo are
        return t.MiniCPM5MoeConfig(**COMMON, intermediate_size=48, head_dim=16, moe_intermediate_size=16,
                                   num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
                                   mlp_layer_types=["sparse", "sparse"])
    if family == "kolibri1_1":
        return t.Kolibri1_1Config(**COMMON, head_dim=16, moe_intermediate_size=16, num_experts_per_tok=2, num_experts=4,
                                  shared_expert_intermediate_size=16, sliding_window=8, mlp_only_layers=[],
                                  index_num_heads=1, index_head_dim=8, index_topk=4)
    if family == "hy_v4":  # DeepSeek-V4's clamped SiLU under its own name; swiglu_limit small enough to bite
        return t.HYV4Config(**COMMON, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                            num_experts_per_tok=2, head_dim=16, n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
                            mlp_layer_types=["sparse", "sparse"], swiglu_limit=0.5, **TOKENS)
    if family == "lfm2_moe":  # its act_fn is the function F.silu, not a module
        return t.Lfm2MoeConfig(**{k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}, intermediate_size=48,
                               moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_dense_layers=0,
                               layer_types=["full_attention", "full_attention"], **TOKENS)
    # non-gated relu2 experts stored x @ W (up_proj [E, H, I]); its ErgoExperts calls them with one route per row
    # (k = 1, weight 1) and normalizes each route's output with its expert's own RMSNorm before the weighted sum
    assert family == "ergo"
    return t.ErgoConfig(**{k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}, num_dense_blocks=0,
                        first_dense_intermediate_size=48, moe_intermediate_size=16, shared_intermediate_size=16,
                        num_experts=4, num_experts_per_tok=2, sliding_window=8)


FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "deepseek_v4", "nemotron_h", "minicpm5_moe",
            "kolibri1_1", "hy_v4", "lfm2_moe", "ergo")
# held x @ W in memory, in these moe.loaders layouts: moe converts them, and releases the module's parameters
TRANSPOSED = {"gpt_oss": "transformers_fused_transposed", "ergo": "transformers_transposed"}
# what save_pretrained writes for layer 0's experts: (moe.loaders layout, key prefix). Ergo's checkpoint keeps its
# experts' tensors beside the router's (layers.0.feed_forward.up_proj), a layout moe.loaders does not read.
SAVED = {"qwen3_moe": ("qwen3", "model.layers.0.mlp."), "mixtral": ("mixtral", "model.layers.0.block_sparse_moe."),
         "gpt_oss": ("gpt_oss", "model.layers.0.mlp."), "deepseek_v3": ("deepseek", "model.layers.0.mlp."),
         "deepseek_v4": ("mixtral", "model.layers.0.ffn."), "nemotron_h": ("nemotron_h", "backbone.layers.1.mixer."),
         "minicpm5_moe": ("qwen3", "model.layers.0.mlp."), "kolibri1_1": ("qwen3", "model.layers.0.mlp."),
         "hy_v4": ("transformers_fused", "model.layers.0.mlp."),
         "lfm2_moe": ("mixtral", "model.layers.0.feed_forward."), "ergo": None}


def tiny_model(family: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(family)).eval()
    with torch.no_grad():  # biases and the V4 correction terms start at zero; make them count
        for name, param in model.named_parameters():
            if name.endswith("_bias") or "experts" in name:
                param.normal_(0, 0.5)
    # drawn in float32, then cast: the bf16 model is the float32 one rounded on every torch (torch 2.11 draws
    # other values for normal_ on a bf16 tensor than on a float32 one)
    return model.to(dtype)


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
    in_place = family not in TRANSPOSED  # only the transposed layouts need a converted copy
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


def test_a_subclass_calling_the_experts_through_super_is_served_and_falls_back_without_recursion():
    """Ergo's ErgoExperts overrides forward and calls the decorated projections through super(): moe serves
    that call, and where it falls back it runs the projections as written, not the override, which would
    call moe again (it recursed without end before)."""
    model = tiny_model("ergo")
    ids = prompt()
    _, module = experts_modules(model)[0]
    assert type(module).forward is not moe_hf._own_forward(module)
    assert moe_hf._own_forward(module).__qualname__ == "ErgoExpertProjections.forward"
    moe_hf.use_moe(model)
    moe_logits(model, ids)
    layers = [m.__dict__["_moe_binding"].layer for _, m in experts_modules(model)]
    assert all(layer is not None and layer.problem.top_k == 1 for layer in layers)  # one route per row
    model = tiny_model("ergo")
    for _, module in experts_modules(model):
        module.act_fn = torch.nn.GELU()  # non-gated GELU: not one moe computes
    expected = eager_logits(model, ids)
    report = moe_hf.use_moe(model)
    assert all(served.startswith("fallback: its non-gated activation GELU") for served in report.values()), report
    got, caught = fallback_warnings(model, ids)
    assert caught == [] and relative_error(got, expected) <= 1e-6


def _token_classifier(limit: float):
    """OpenAI's privacy filter: a token classifier whose experts are GPT-OSS's, stored x @ W with [gate | up] halves."""
    config = transformers.OpenAIPrivacyFilterConfig(**COMMON, intermediate_size=16, num_local_experts=4,
                                                    num_experts_per_tok=2, head_dim=16, sliding_window=8,
                                                    swiglu_limit=limit, **TOKENS)
    torch.manual_seed(0)
    model = transformers.AutoModelForTokenClassification.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "experts" in name:
                param.normal_(0, 0.5)
    return model


def test_gpt_oss_gates_on_concatenated_halves_are_served_with_their_clamp():
    model = _token_classifier(limit=0.5)  # small enough that the clamp bites
    _, module = experts_modules(model)[0]
    spec = moe_hf._read(module)
    assert spec.layout == "transformers_transposed" and spec.activation == moe.Activation.parse(
        "swiglu_oai", alpha=module.alpha, beta=1.0, limit=0.5)
    ids = prompt()
    expected = eager_logits(model, ids)
    assert all("fallback" not in served for served in moe_hf.use_moe(model).values())
    assert relative_error(moe_logits(model, ids), expected) <= 1e-4
    unclamped = _token_classifier(limit=1e4)
    moe_hf.use_moe(unclamped)
    assert relative_error(moe_logits(unclamped, ids), expected) > 1e-2  # the limit changed the result


def test_a_gate_clamped_after_its_activation_falls_back_and_one_without_a_limit_is_served():
    """Ling's (bailing_hybrid) experts clamp silu(gate) at the limit, after the activation."""
    def tiny(limits):
        config = transformers.BailingHybridConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                                  num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                  n_shared_experts=1, first_k_dense_replace=0, swiglu_limits=limits,
                                                  **TOKENS)
        return experts_modules(transformers.AutoModelForCausalLM.from_config(config))[0][1]

    assert moe_hf._read(tiny([0, 0])).activation == moe.Activation.parse("silu")  # 0: no limit
    assert moe_hf._read(tiny([0.5, 0.5])) == ("its gate clamps silu(gate) at limit=0.5 after the activation, which "
                                              "moe does not")


@pytest.mark.parametrize("family", TRANSPOSED)
def test_a_released_module_refuses_another_implementation_until_unuse_moe(family):
    """Released parameters are meta placeholders; Ergo's own forward computed with them silently (a CPU
    tensor times a meta one is a CPU tensor, and an index_put of a meta value writes nothing)."""
    model = tiny_model(family)
    ids = prompt()
    expected = eager_logits(model, ids)
    moe_hf.use_moe(model)
    assert relative_error(moe_logits(model, ids), expected) <= 1e-4
    with pytest.raises(moe.MoEConfigError, match="cannot run on another implementation; call unuse_moe"):
        eager_logits(model, ids)
    moe_hf.unuse_moe(model, "eager")
    assert relative_error(eager_logits(model, ids), expected) <= 1e-6


def test_activation_functions_are_read_as_their_modules_are():
    _, module = experts_modules(tiny_model("mixtral"))[0]
    del module.act_fn  # a submodule here; LFM2-MoE's is a plain attribute
    module.act_fn = torch.nn.functional.gelu  # the exact (erf) GELU, as GELUActivation
    assert moe_hf._read(module).activation == moe.Activation.parse("gelu")
    module.act_fn = torch.tanh
    assert moe_hf._read(module) == "its activation tanh is not one moe computes (silu, gelu gated; relu2 non-gated)"


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
    with pytest.raises(moe.MoEConfigError, match=r"released to moe .* call unuse_moe\(model\) first"):
        eager_logits(model, ids)  # another implementation needs the parameters back first
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
    name, module = experts_modules(model)[0]
    top_k = 1 if family == "ergo" else 2  # Ergo's projections take one route per row, its weights unused (1)
    if SAVED[family] is not None:
        layout, prefix = SAVED[family]
        _check_loaded(module, saved, layout, prefix, top_k)
    memory_layout = TRANSPOSED.get(family, "transformers_fused")
    _check_loaded(module, in_memory, memory_layout, name.removesuffix("experts"), top_k)


def _check_loaded(module, tensors, layout, prefix, top_k):
    """A FusedMoE loaded from ``tensors`` computes what the module's own eager forward does."""
    weights = load_experts(tensors, layout, num_experts=4, prefix=prefix)
    activation = moe_hf._read(module).activation
    layer = moe.FusedMoE(4, top_k, weights.hidden_size, weights.intermediate_size, activation=activation,
                         quant="fp32", dtype=torch.float32, has_bias=weights.has_bias)
    layer.load_checkpoint(tensors, layout, prefix=prefix)
    x = torch.randn(6, weights.hidden_size, generator=torch.Generator().manual_seed(2))
    ids = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t))[:top_k] for t in range(6)])
    topk_weights = torch.rand(6, top_k, generator=torch.Generator().manual_seed(3)) if top_k > 1 else torch.ones(6, 1)
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
