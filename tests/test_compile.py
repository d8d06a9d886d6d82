"""FusedMoE under torch.compile: the forward is one custom op (``moe::fused_moe``), compiled callables
match eager for every routing form, one graph serves every M, checks still fire, and the op passes
``torch.library.opcheck``.

On this CPU machine the plan picks local + torch_grouped for a float32 layer (asserted below), so the
compiled graphs call through those experts; inductor is the backend (it compiles here).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import moe.custom_op
from moe import FusedMoE, MoEConfigError, TopK, UnsupportedError
from moe.custom_op import layer_of, mark_tokens_dynamic

E, K, H, I, MAX_TOKENS = 4, 2, 64, 32, 64
TOKEN_COUNTS = (1, 2, 3, 17, 64, MAX_TOKENS)
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # 64 is max_tokens too: the largest bucket's edge


def make_layer(**kwargs) -> FusedMoE:
    layer = FusedMoE(E, K, H, I, dtype=torch.float32, quant="fp32", max_tokens=MAX_TOKENS, **kwargs)
    layer.load_weights(w13=torch.randn(E, 2 * I, H) / 8, w2=torch.randn(E, H, I) / 6)
    return layer


class Block(torch.nn.Module):
    """What model code looks like around the layer: a router Linear, the experts, a residual."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = make_layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(x, self.gate(x))


def graphs_of(fn):
    """``fn`` compiled with fullgraph=True through a backend that keeps each dynamo graph (and runs it as is)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return torch.compile(fn, backend=backend, fullgraph=True), graphs


def ops_in(graph: torch.fx.GraphModule) -> list:
    return [node.target for node in graph.graph.nodes if node.op == "call_function"]


def test_cpu_plan_compiles_through_torch_grouped():
    # what the compiled tests below run through on this machine
    assert repr(make_layer().kernel) == "ModularKernel(local + torch_grouped)"


@pytest.mark.parametrize("form", ["logits", "topk_ids", "topk", "shared_output"])
def test_forward_is_one_opaque_custom_op(form):
    """Every routing form reaches the compiler as one moe::fused_moe call: no workspace view, no
    bucket lookup and no weight is in the graph (the tensors in it are the inputs only)."""
    layer = make_layer()
    x, logits = torch.randn(5, H), torch.randn(5, E)
    compiled, graphs = graphs_of(layer)
    out = compiled(x, **routing(layer, form, x, logits))
    assert len(graphs) == 1
    ops = ops_in(graphs[0])
    assert ops.count(torch.ops.moe.fused_moe.default) == 1
    assert all(op is torch.ops.moe.fused_moe.default or "to" in str(op) for op in ops), ops  # dtype casts of ids
    assert not [n for n in graphs[0].graph.nodes if n.op == "get_attr"]  # no weight, no workspace
    torch.testing.assert_close(out, layer(x, **routing(layer, form, x, logits)), rtol=0, atol=0)


def routing(layer: FusedMoE, form: str, x: torch.Tensor, logits: torch.Tensor) -> dict:
    """The keyword arguments of each routing form for the same routing (ids int64 as transformers returns)."""
    topk = layer.router(logits)
    if form == "logits":
        return {"router_logits": logits}
    if form == "shared_output":
        return {"router_logits": logits, "shared_output": x * 0.5}
    if form == "topk":
        return {"topk": topk}
    # standard strides: topk's [1, k] output has others, and dynamo guards on the strides of its inputs
    return {"topk_ids": topk.ids.long().clone(memory_format=torch.contiguous_format), "topk_weights": topk.weights}


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("form", ["logits", "topk_ids", "shared_output"])
def test_inductor_compiled_layer_matches_eager(form, fullgraph):
    layer = make_layer()
    compiled = torch.compile(layer, fullgraph=fullgraph)
    for tokens in (3, 9):
        x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
        kwargs = routing(layer, form, x, logits)
        torch.testing.assert_close(compiled(x, **kwargs), layer(x, **kwargs), rtol=0, atol=0)


def test_compiled_model_block_matches_eager_with_one_graph_for_every_token_count():
    """Router Linear + layer + residual, compiled once (inductor, fullgraph) with M marked dynamic on the
    input: M = 1, 2, 3, 17, 64 (= max_tokens) and 0 all run the same graph."""
    block = Block()
    compiled = torch.compile(block, fullgraph=True)
    first = torch.randn(TOKEN_COUNTS[0], H)
    mark_tokens_dynamic(first)
    for x in [first] + [torch.randn(m, H) for m in TOKEN_COUNTS[1:] + (0,)]:
        torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["aot_autograd"]["total"] == 1  # one graph handed to the backend, never another


@pytest.mark.parametrize("form", ["logits", "topk_ids"])
def test_no_recompile_across_token_counts_when_marked(form):
    layer = make_layer()
    compiled = torch.compile(layer, fullgraph=True)
    for i, tokens in enumerate(TOKEN_COUNTS):
        x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
        kwargs = routing(layer, form, x, logits)
        if i == 0:
            mark_tokens_dynamic(x, *kwargs.values())
        torch.testing.assert_close(compiled(x, **kwargs), layer(x, **kwargs), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1


def test_unmarked_token_count_recompiles_once_past_the_specialized_sizes():
    """What users get without marking M: dynamo specializes the first M (here 1), compiles again
    dynamic for the next, and then serves the rest; documented in FusedMoE.forward."""
    layer = make_layer()
    compiled = torch.compile(layer, fullgraph=True)
    for tokens in TOKEN_COUNTS:
        x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
        torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("call, message", [
    (lambda f, x, g: f(x.double(), g), "hidden_states must be torch.float32"),
    (lambda f, x, g: f(x, g[:, :3]), "router_logits must be [M, num_experts] = [4, 4]"),
    (lambda f, x, g: f(x, g, x[:2]), "shared_output must match hidden_states"),
    (lambda f, x, g: f(x, topk_ids=g.long()[:, :K]), "topk_ids and topk_weights go together"),
    (lambda f, x, g: f(x, topk_ids=torch.zeros(4, K + 1, dtype=torch.long), topk_weights=torch.rand(4, K + 1)),
     "topk_ids must be [M, top_k] = [4, 2]"),
])
def test_argument_checks_still_raise_under_compile(call, message):
    """At trace time: compiled, the layer raises the eager error; with fullgraph=True dynamo may report it
    as an Unsupported "Observed exception" that quotes it (dynamo's own wrapping)."""
    layer = make_layer()
    x, logits = torch.randn(4, H), torch.randn(4, E)
    with pytest.raises(MoEConfigError) as eager:
        call(layer, x, logits)
    assert message in str(eager.value)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        with pytest.raises((MoEConfigError, torch._dynamo.exc.Unsupported)) as compiled:
            call(torch.compile(layer, fullgraph=fullgraph), x, logits)
        assert message in str(compiled.value), fullgraph


def test_token_count_over_max_tokens_raises_under_compile_with_unbacked_m():
    # an unbacked M cannot be compared at trace time: the op's bucket lookup raises when it runs
    compiled = torch.compile(make_layer(), fullgraph=True)
    x, logits = torch.randn(3, H), torch.randn(3, E)
    mark_tokens_dynamic(x, logits)
    compiled(x, logits)
    with pytest.raises(MoEConfigError, match="exceeds max_tokens=64"):
        compiled(torch.randn(MAX_TOKENS + 1, H), torch.randn(MAX_TOKENS + 1, E))


@pytest.mark.parametrize("compiled", [False, True])
def test_out_of_range_ids_raise_inside_the_op_compiled_or_not(compiled):
    layer = make_layer()
    call = torch.compile(layer, fullgraph=True) if compiled else layer
    x, ids = torch.randn(3, H), torch.tensor([[0, 1], [2, E], [1, 3]])
    with pytest.raises(MoEConfigError, match=r"topk_ids must lie in \[0, num_experts=4\) \(got values in \[0, 4\]\)"):
        call(x, topk_ids=ids, topk_weights=torch.rand(3, K))
    with pytest.raises(MoEConfigError, match=r"topk.ids must lie in \[0, num_experts=4\)"):
        call(x, topk=TopK(ids.int(), torch.rand(3, K)))


def test_id_check_is_skipped_while_a_cuda_graph_is_captured(monkeypatch):
    """No host read during capture (it would fail there): validate=True then checks nothing, on purpose."""
    layer = make_layer()
    seen = []
    monkeypatch.setattr(moe.custom_op, "check_ids_in_range", lambda problem, ids, name: seen.append(name))
    x, topk = torch.randn(3, H), layer.router(torch.randn(3, E))
    layer(x, topk_ids=topk.ids, topk_weights=topk.weights)
    assert seen == ["topk_ids"]
    monkeypatch.setattr(moe.custom_op, "_capturing", lambda tensor: True)
    layer(x, topk_ids=topk.ids, topk_weights=topk.weights)
    layer(x, topk_ids=topk.ids, topk_weights=topk.weights, validate=False)
    assert seen == ["topk_ids"]


@pytest.mark.parametrize("form", ["logits", "topk_ids", "shared_output", "input_ids"])
def test_opcheck(form):
    layer = make_layer()
    x, logits = torch.randn(5, H), torch.randn(5, E)
    topk = layer.router(logits)
    shared = x * 0.5 if form == "shared_output" else None
    if form == "topk_ids":
        args = (x, None, topk.ids, topk.weights, None, None, layer._handle, True, "topk_ids")
    elif form == "input_ids":  # the token ids hash routing reads travel as an op argument too
        args = (x, logits, None, None, None, torch.arange(5), layer._handle, False, "")
    else:
        args = (x, logits, None, None, shared, None, layer._handle, False, "")
    torch.library.opcheck(torch.ops.moe.fused_moe.default, args)


def test_compiles_with_gradients_enabled_and_a_backward_fails_clearly():
    """The router's Linear needs gradients, so AOTAutograd traces a backward through the op at compile
    time: that works, and running a backward raises (no gradient is silently missing)."""
    block = Block()
    x = torch.randn(3, H)
    for call in (block, torch.compile(block, fullgraph=True)):
        out = call(x)
        torch.testing.assert_close(out, block(x).detach(), rtol=1e-5, atol=1e-5)
        with pytest.raises(UnsupportedError, match="FusedMoE has no backward"):
            out.sum().backward()


def test_a_copy_answers_to_its_own_handle_and_a_freed_layer_to_none():
    layer = make_layer()
    twin = copy.deepcopy(layer)
    assert twin._handle != layer._handle and layer_of(twin._handle) is twin
    twin.load_weights(w13=torch.randn(E, 2 * I, H) / 8, w2=torch.randn(E, H, I) / 6)  # the copy's own weights
    x, logits = torch.randn(4, H), torch.randn(4, E)
    assert not torch.equal(twin(x, logits), layer(x, logits))
    handle = twin._handle
    del twin
    gc.collect()
    with pytest.raises(MoEConfigError, match=f"layer handle {handle}, which names no live FusedMoE"):
        layer_of(handle)


def test_an_eager_forward_skips_the_dispatcher_and_torch_dynamo():
    """In eager mode without gradients the op's body runs directly: the op's first call imports
    torch._dynamo, which made a layer's first forward take 2.2 s on an H100 (benchmarks/load_time.py)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, moe\n"
        "layer = moe.FusedMoE(4, 2, 16, 8, dtype=torch.float32, quant='fp32')\n"
        "layer.load_weights(w13=torch.randn(4, 16, 16), w2=torch.randn(4, 16, 8))\n"
        "with torch.no_grad():\n"
        "    layer(torch.randn(3, 16), torch.randn(3, 4))\n"
        "layer(torch.randn(3, 16), topk_ids=torch.zeros(3, 2, dtype=torch.long), topk_weights=torch.ones(3, 2))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
