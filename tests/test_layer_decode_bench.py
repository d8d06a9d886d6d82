"""benchmarks/layer_decode.py end to end on a CPU (float32, H and I divided by 16, no graphs): every
(preset, scheme, M) gets a row with times, the layer path and the experts path it times agree, a
backend that cannot serve is a row with its reason, and the agreement check does catch a mismatch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import benchmark_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "layer_decode.py"
SMOKE = ["--device", "cpu", "--dtype", "float32", "--scale", "16", "--budget-ms", "1", "--rotations", "2"]


def _script():
    return benchmark_script("layer_decode")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny CPU ops: on a shared 2-core machine two threads made the smoke run 4x slower (77 s against 17 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_preset_scheme_and_m_is_timed_on_paths_that_agree(tmp_path, capsys):
    bench = _script()
    out = tmp_path / "cells.json"
    bench.main(SMOKE + ["--experts", "oracle", "--quant", "bf16,nvfp4", "--json", str(out), "--machine", "cpu-test"])
    saved = json.loads(out.read_text())
    cells = saved["cells"]
    assert saved["machine"] == "cpu-test" and saved["scale"] == 16 and saved["dtype"] == "float32"
    presets = [f"{p}-scaled" for p in bench.PRESETS]
    # bf16 runs as the unquantized scheme of --dtype: fp32
    want = {(p, s, m) for p in presets for s in ("fp32", "nvfp4") for m in bench.TOKENS}
    assert [(c["preset"], c["scheme"], c["tokens"]) for c in cells] == sorted(
        want, key=lambda k: (presets.index(k[0]), k[1] != "fp32", k[2]))
    table = capsys.readouterr().out
    base = {(c["preset"], c["tokens"]): c["layer_us"] for c in cells if c["scheme"] == "fp32"}
    for c in cells:
        assert c["error"] == "" and c["graphs"] is False
        assert all(math.isfinite(c[k]) and c[k] > 0 for k in ("experts_us", "layer_us")), c
        assert c["ratio"] == c["layer_us"] / c["experts_us"]
        assert c["vs_base"] == c["layer_us"] / base[c["preset"], c["tokens"]]
        # the layer's output, the experts stage's (summed over k) and the kernel's on the same routing
        assert c["err"] <= 1e-6, c
        assert c["experts"] == ("torch_grouped" if c["scheme"] == "fp32" else "reference")
        row = f"| {c['preset']} | {c['scheme']} | oracle>{c['experts']} | {c['tokens']} | {c['experts_us']:.1f} |"
        assert row in table


def test_forced_backends_time_skip_the_oracles_own_and_list_refusals(capsys):
    bench = _script()
    argv = SMOKE + ["--preset", "qwen3-30b-a3b", "--tokens", "1", "--rotations", "1",
                    "--experts", "oracle,torch_grouped,triton,flashinfer_cutlass"]
    cells = bench.main(argv)
    # torch_grouped is what the oracle ran at every M: timed once, as the oracle's row
    assert [(c.backend, c.experts) for c in cells] == [("oracle", "torch_grouped"), ("triton", "triton"),
                                                      ("flashinfer_cutlass", "")]
    triton = cells[1]
    assert triton.error == "" and triton.experts_us > 0 and triton.layer_us > 0 and triton.err <= 1e-5
    refused = cells[2]  # CUDA-only: a row that names why, not a crash
    assert refused.error.startswith("UnsupportedError") and "runs on ['cuda'], not cpu" in refused.error
    assert math.isnan(refused.layer_us)
    assert f"| flashinfer_cutlass | 1 | {refused.error} |" in capsys.readouterr().out


def test_the_agreement_check_sees_either_path_computing_something_else():
    bench = _script()
    args = bench.parse_args(SMOKE + ["--preset", "qwen3-30b-a3b", "--tokens", "4"])
    preset = bench.load_preset("qwen3-30b-a3b").scaled(max_hidden=128, max_intermediate=48, max_experts=128)
    with torch.inference_mode():
        layer = bench.build_layer(preset, "fp32", "torch_grouped", args)
        kernel = layer.kernel_for(4)
        inputs = bench.layer_inputs(layer, 4, 1)
        stage = bench.backend_calls(type(kernel.experts), kernel.problem, None, [(h, t) for h, _, t in inputs],
                                    layer.device, experts=kernel.experts, prepared=kernel.prepared_weights)
        assert bench.agreement(layer, kernel, inputs, stage) <= 1e-6
        hidden, logits, topk = inputs[0]
        other = [(hidden, -logits, topk)]  # the layer now routes other logits than the kernel path's routing
        assert bench.agreement(layer, kernel, other, stage) > 0.1
        # and an experts stage timed on other routing than the layer's
        wrong = bench.backend_calls(type(kernel.experts), kernel.problem, None, [(hidden, layer.router(-logits))],
                                    layer.device, experts=kernel.experts, prepared=kernel.prepared_weights)
        assert bench.agreement(layer, kernel, inputs, wrong) > 0.1
