"""`moe.synthetic.random_dense`: the one random-weights generator of the demos, the bench and the kit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe.testing.inputs
from moe.presets import load_preset
from moe.problem import MoEProblem, ParallelConfig
from moe.synthetic import random_dense
from moe.tools import demo, ep_demo
from moe.tools.bench import build_weights
from moe.weights import ExpertWeights


def _problem(**kwargs) -> MoEProblem:
    return MoEProblem.create(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, **kwargs)


def test_shapes_scales_and_dtypes():
    p = _problem(has_bias=True, parallel=ParallelConfig(ep_size=2, ep_rank=1))
    dense = random_dense(p, torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    shapes = {name: tuple(t.shape) for name, t in dense.items()}
    assert shapes == {"w13": (4, 256, 256), "w2": (4, 256, 128), "b13": (4, 256), "b2": (4, 256)}  # local experts
    assert dense["w13"].dtype == dense["w2"].dtype == torch.bfloat16
    assert dense["b13"].dtype == dense["b2"].dtype == torch.float32  # what ExpertWeights keeps biases in
    # each row of w13 has variance 1/H, of w2 1/I; biases 0.1 N(0, 1)
    for name, std in (("w13", 256**-0.5), ("w2", 128**-0.5), ("b13", 0.1), ("b2", 0.1)):
        assert dense[name].float().std().item() == pytest.approx(std, rel=0.05), name


def test_a_seed_draws_the_same_weights():
    p = _problem()
    first, second = (random_dense(p, torch.Generator().manual_seed(5)) for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["w13"], random_dense(p, torch.Generator().manual_seed(6))["w13"])


def test_the_kit_demos_and_bench_draw_from_the_one_generator():
    assert moe.testing.inputs.random_dense is random_dense
    p = _problem(quant="bf16", has_bias=True)
    # the EP demo: every expert of the layer, even for a sharded problem
    sharded = dataclasses.replace(p, parallel=ParallelConfig(ep_size=2, ep_rank=0))
    full = ep_demo.random_layer(sharded, seed=3)
    expected = ExpertWeights.from_dense(**random_dense(p, torch.Generator().manual_seed(3)), quant="bf16",
                                        dtype=p.dtype)
    assert full.num_experts == 8 and torch.equal(full.w13.data, expected.w13.data)
    assert torch.equal(full.b2, expected.b2)
    # the bench, on the device it times (here the CPU)
    drawn = build_weights(p, torch.device("cpu"))
    again = random_dense(p, torch.Generator().manual_seed(0), "cpu", p.dtype)
    assert torch.equal(drawn.w2.data, again["w2"]) and torch.equal(drawn.b13, again["b13"])


def test_the_demo_layer_loads_the_generators_weights():
    preset = load_preset("gpt-oss-20b").scaled(**demo.CPU_LIMITS)
    layer = demo._build(preset, 3, "bf16", "reference", "cpu")
    dense = random_dense(layer.problem, torch.Generator().manual_seed(1))
    assert torch.equal(layer.weights.w13.data, dense["w13"].to(layer.problem.dtype))
    assert torch.equal(layer.weights.b13, dense["b13"])
