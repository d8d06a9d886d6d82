"""``python -m moe demo``: a real model's MoE layer composed, run, checked against ``reference`` and timed."""

from __future__ import annotations

import statistics
import time

import torch

from moe.experts.reference import ReferenceExperts
from moe.kernel import ModularKernel
from moe.layer import FusedMoE
from moe.prepare_finalize import LocalPrepareFinalize
from moe.presets import load_preset
from moe.testing import TOLERANCES, regime_for, relative_error

# On a CPU the full layers (Mixtral: 8 x 176M parameters) would take minutes and gigabytes, so the
# demo keeps the model's structure (k, activation, routing, bias, scheme) and shrinks the sizes.
CPU_LIMITS = dict(max_hidden=512, max_intermediate=384, max_experts=32)


def run_demo(preset_name: str, tokens: int, quant: str | None, experts: str | None,
             device: str | None, full_size: bool) -> int:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = load_preset(preset_name)
    if device == "cpu" and not full_size:
        small = preset.scaled(**CPU_LIMITS)
        if (small.num_experts, small.hidden_size, small.intermediate_size) != (
            preset.num_experts, preset.hidden_size, preset.intermediate_size):
            print(f"note: on CPU the layer is scaled down from E={preset.num_experts}, H={preset.hidden_size}, "
                  f"I={preset.intermediate_size} to E={small.num_experts}, H={small.hidden_size}, "
                  f"I={small.intermediate_size} (same k, activation, routing; --full-size to keep it)")
        preset = small
    dtype = torch.bfloat16
    quant = quant or "bf16"
    layer = FusedMoE(
        preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size,
        activation=preset.activation, quant=quant, routing=preset.routing, has_bias=preset.has_bias,
        dtype=dtype, device=device, max_tokens=max(tokens, 1), experts=experts,
        **_router_options(preset, device),
    )
    p = layer.problem
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(p.num_experts, p.w13_rows, p.hidden_size, generator=gen) / p.hidden_size**0.5
    w2 = torch.randn(p.num_experts, p.hidden_size, p.intermediate_size, generator=gen) / p.intermediate_size**0.5
    biases = {}
    if p.has_bias:
        biases = dict(b13=0.1 * torch.randn(p.num_experts, p.w13_rows, generator=gen),
                      b2=0.1 * torch.randn(p.num_experts, p.hidden_size, generator=gen))
    layer.load_weights(w13=w13, w2=w2, **biases)
    hidden = torch.randn(tokens, p.hidden_size, generator=gen).to(device, dtype)
    logits = torch.randn(tokens, p.num_experts, generator=gen).to(device)

    out = layer(hidden, logits)
    times = _time(lambda: layer(hidden, logits), device)
    reference = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p), device=device)
    ref = reference.forward(hidden, layer.router(logits), reference.experts.prepare_weights(layer.weights))
    err, regime = relative_error(out, ref), regime_for(p)
    ok = err <= TOLERANCES[regime]

    print(f"preset      {preset.name} ({preset.source}): E={p.num_experts} k={p.top_k} H={p.hidden_size} "
          f"I={p.intermediate_size} activation={p.activation.name} routing={preset.routing} "
          f"bias={p.has_bias} quant={p.quant_name}")
    print(f"device      {device} ({layer.platform.name})")
    print(f"kernel      {layer.kernel!r}")
    print(f"tokens      M={tokens} -> out {list(out.shape)} {out.dtype}")
    print(f"workspace   {layer.kernel.workspace_bytes(tokens):,} bytes for M={tokens} "
          f"({layer.kernel.workspace_bytes():,} for max_tokens={p.max_tokens})")
    print(f"vs reference relative error {err:.2e} (bound {TOLERANCES[regime]:.0e}, {regime}) -> "
          f"{'OK' if ok else 'FAIL'}")
    print(f"time        {statistics.median(times) * 1e3:.3f} ms median of {len(times)} runs")
    return 0 if ok else 1


def _router_options(preset, device: str) -> dict:
    options = preset.router_options()
    if preset.has_correction_bias:
        options["correction_bias"] = 0.01 * torch.randn(preset.num_experts).to(device)
    return options


def _time(fn, device: str, runs: int = 10) -> list[float]:
    fn()
    times = []
    for _ in range(runs):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times
