"""``python -m moe demo``: a real model's MoE layer composed, run, checked and timed.

The check is independent of the code it checks: `dequantize_then_compute` recomputes the layer in
float32 from its own quantized weights with nothing but ``moe.quant`` and the activation's math -- no
Experts backend, not even ``reference`` (which the oracle picks where nothing faster serves, and which
would then be checked against itself). The difference is judged by the tolerance regime of the
layer's scheme and dtype (`moe.tolerance`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from moe.errors import UnsupportedError
from moe.layer import FusedMoE
from moe.presets import load_preset
from moe.problem import MoEProblem
from moe.quant import UNQUANTIZED, QuantFormat, QuantizedTensor, dequantize, quantize
from moe.router import TopK
from moe.synthetic import random_dense
from moe.tolerance import relative_error, tolerance_for
from moe.weights import ExpertWeights

# On a CPU the full layers (Mixtral: 8 x 176M parameters) would take minutes and gigabytes, so the
# demo keeps the model's structure (k, activation, routing, bias, scheme) and shrinks the sizes.
CPU_LIMITS = dict(max_hidden=512, max_intermediate=384, max_experts=32)


def run_demo(preset_name: str, tokens: int, quant: str, experts: str | None,
             device: str | None, full_size: bool) -> int:
    """Builds the preset's layer (scaled down on CPU unless ``full_size``), runs ``tokens`` tokens,
    checks the output against `dequantize_then_compute` and times it. Returns 0 when the check
    passes, 1 when it fails. Arguments are the CLI's flags, already validated there."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = _sized(load_preset(preset_name), device, full_size)
    _check_memory(preset)
    layer = _build(preset, tokens, quant, experts, device)
    p = layer.problem
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, p.hidden_size, generator=gen).to(device, p.dtype)
    logits = torch.randn(tokens, p.num_experts, generator=gen).to(device)

    out = layer(hidden, logits)
    times = _time(lambda: layer(hidden, logits), device)
    check, ok = _check(layer, hidden, logits, out, forced=experts is not None)

    print(f"preset      {preset.name} ({preset.source}): E={p.num_experts} k={p.top_k} H={p.hidden_size} "
          f"I={p.intermediate_size} activation={p.activation.name} routing={preset.routing} "
          f"bias={p.has_bias} quant={p.quant_name} dtype={str(p.dtype).removeprefix('torch.')}")
    print(f"device      {device} ({layer.platform.name})")
    print(f"kernel      {layer.kernel_for(tokens)!r}")
    print(f"tokens      M={tokens} -> out {list(out.shape)} {out.dtype}")
    print(f"workspace   {layer.kernel.workspace_bytes(tokens):,} bytes for M={tokens} "
          f"({layer.kernel.workspace_bytes():,} for max_tokens={p.max_tokens})")
    print(check)
    print(f"time        {statistics.median(times) * 1e3:.3f} ms median of {len(times)} runs")
    return 0 if ok else 1


def _sized(preset, device: str, full_size: bool):
    """The preset, scaled down to `CPU_LIMITS` on a CPU unless ``full_size`` (saying so when it shrinks)."""
    if device != "cpu" or full_size:
        return preset
    small = preset.scaled(**CPU_LIMITS)
    if (small.num_experts, small.hidden_size, small.intermediate_size) != (
            preset.num_experts, preset.hidden_size, preset.intermediate_size):
        print(f"note: on CPU the layer is scaled down from E={preset.num_experts}, H={preset.hidden_size}, "
              f"I={preset.intermediate_size} to E={small.num_experts}, H={small.hidden_size}, "
              f"I={small.intermediate_size} (same k, activation, routing; --full-size to keep it)")
    return small


def _check_memory(preset) -> None:
    """UnsupportedError when the float32 weights the demo draws (on the host) exceed the host's memory:
    the full DeepSeek-V3 layer takes 45 GB, which would swap or be killed rather than fail."""
    p = preset.problem()
    need = 4 * p.num_experts * (p.w13_rows * p.hidden_size + p.hidden_size * p.intermediate_size)
    have = host_memory_bytes()
    if need > have:
        raise UnsupportedError(f"the {preset.name} layer's weights take {need / 1e9:.1f} GB in float32 as the demo "
                               f"draws them, more than this machine's {have / 1e9:.1f} GB of memory; "
                               "drop --full-size or choose a smaller --preset")


def host_memory_bytes() -> int:
    """Physical memory of this machine, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _build(preset, tokens: int, quant: str, experts: str | None, device: str) -> FusedMoE:
    """The layer with random weights (`moe.synthetic.random_dense`, seed 1), loaded."""
    # an unquantized scheme name is the dtype ("fp16" runs float16); quantized schemes run bfloat16
    dtype = UNQUANTIZED.get(quant, torch.bfloat16)
    layer = FusedMoE(
        preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size,
        activation=preset.activation, quant=quant, routing=preset.routing, has_bias=preset.has_bias,
        dtype=dtype, device=device, max_tokens=max(tokens, 1), experts=experts,
        **_router_options(preset, device),
    )
    layer.load_weights(**random_dense(layer.problem, torch.Generator().manual_seed(1)))
    return layer


def _check(layer: FusedMoE, hidden: torch.Tensor, logits: torch.Tensor, out: torch.Tensor,
           forced: bool) -> tuple[str, bool]:
    """The check's report, and whether it passed; ``forced``: the experts were chosen by --experts."""
    p = layer.problem
    if hidden.shape[0] == 0:
        ok = tuple(out.shape) == (0, p.hidden_size)
        return (f"check       none: M=0 gives no values to compare (only the output's shape, "
                f"{list(out.shape)}, is checked) -> {'OK' if ok else 'FAIL'}"), ok
    expected = dequantize_then_compute(p, layer.weights, hidden, layer.router(logits))
    err, tolerance = relative_error(out, expected), tolerance_for(p)
    ok = err <= tolerance.bound
    line = (f"check       vs an independent float32 loop (dequantize, then compute): relative error "
            f"{err:.2e} (bound {tolerance.bound:.0e}, {tolerance.regime}) -> {'OK' if ok else 'FAIL'}")
    if layer.kernel_for(hidden.shape[0]).experts.name == "reference":
        why = "forced by --experts" if forced else f"nothing faster serves {p.quant_name} on {layer.platform.name}"
        line += (f"\n            the layer runs the reference experts itself ({why}), "
                 "so it is checked against an independent float32 loop, not against itself")
    return line, ok


def dequantize_then_compute(problem: MoEProblem, weights: ExpertWeights, hidden: torch.Tensor,
                            topk: TopK) -> torch.Tensor:
    """The layer's output the slow, obvious way: float32 ``[M, H]`` for ``hidden [M, H]``.

    Each token adds, over its k experts, ``weight * (w2 @ act(w13 @ x + b13) + b2)``, with the
    weights of each expert a token picks dequantized by ``moe.quant`` (``weights`` holds all E
    experts) and ``act`` from ``moe.activation``. Where the scheme quantizes activations, ``x`` and
    the intermediate are rounded through that format, as every kernel's inputs are, so the difference
    from a kernel measures only rounding inside the computation. Shares no code with any backend.
    """
    fmt, k = problem.quant.activation, problem.top_k
    x = _rounded(hidden, fmt)
    ids, route_weights = topk.ids.long(), topk.weights.float()  # [M, k]
    picked = [(e, *(ids == e).nonzero(as_tuple=True)) for e in ids.unique().tolist()]  # (e, tokens, slots)
    inter = x.new_zeros(x.shape[0], k, problem.intermediate_size)
    for e, tokens, slots in picked:
        h = x[tokens] @ _expert(weights.w13, e).T
        if weights.b13 is not None:
            h = h + weights.b13[e].float()
        inter[tokens, slots] = problem.activation(h)
    # the intermediate is rounded as one [M * k, I] tensor, like the second GEMM's input in a kernel
    inter = _rounded(inter.reshape(-1, problem.intermediate_size), fmt).reshape(inter.shape)
    out = x.new_zeros(x.shape[0], problem.hidden_size)
    for e, tokens, slots in picked:
        y = inter[tokens, slots] @ _expert(weights.w2, e).T
        if weights.b2 is not None:
            y = y + weights.b2[e].float()
        out.index_add_(0, tokens, route_weights[tokens, slots].unsqueeze(1) * y)
    return out


def _rounded(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Activations ``x [n, K]`` in float32, through ``fmt`` and back where it is a quantized format."""
    if fmt is QuantFormat.NONE or x.shape[0] == 0:
        return x.float()
    return dequantize(quantize(x, fmt, "activation"), torch.float32)


def _expert(weight: QuantizedTensor, e: int) -> torch.Tensor:
    """Expert ``e``'s ``[N, K]`` slice of a stored ``[E, N, K]`` weight, dequantized to float32."""
    one = lambda t: t if t is None or t.dim() == 0 else t[e:e + 1]  # noqa: E731 -- scales are per expert too
    sliced = dataclasses.replace(weight, data=weight.data[e:e + 1], scale=one(weight.scale),
                                 global_scale=one(weight.global_scale))
    return dequantize(sliced, torch.float32)[0]


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
