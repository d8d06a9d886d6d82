"""benchmarks/k_scaling.py on a CPU: the K argument of a launch is found by name and replaced, the cut K values are
whole K steps, the fit's arithmetic, and a machine without a GPU gets a clear answer."""

from __future__ import annotations

import pytest
import torch

from moe.experts._triton.gemm import Launch
from tests.helpers import benchmark_script

SCRIPT = "k_scaling"


def _launch(module: str, name: str, names: list[str], constexprs: dict) -> Launch:
    """A launch whose arguments are their own names, as the launchers pass them: positional up to the constexprs."""
    return Launch((1,), tuple(names), constexprs, kernel=(module, name))


def test_the_tma_a_kernels_k_is_replaced_by_name():
    runtime = ["a_desc", "w_desc", "bias_ptr", "out_ptr", "rows_ptr", "ends_ptr", "counts_ptr", "num_m_blocks",
               "num_experts", "N", "K", "w_rows"]
    launch = _launch("gemm_tma_a", "moe_gemm_tma_a_kernel", runtime, dict(GATED=True, num_warps=8))
    cut = benchmark_script(SCRIPT).with_k(launch, 512)
    assert cut.args[runtime.index("K")] == 512
    assert [a for i, a in enumerate(cut.args) if i != runtime.index("K")] == [a for a in runtime if a != "K"]


def test_the_ws_kernels_k_is_replaced_by_name():
    """The ws kernel takes its output's TMA descriptor third and the unsorted rows' pointer fourth: K sits two places
    later than in the TMA-A kernel."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="needs Triton with Gluon")
    runtime = ["a_desc", "w_desc", "out_desc", "x_ptr", "bias_ptr", "out_ptr", "rows_ptr", "ends_ptr", "counts_ptr",
               "num_experts", "N", "K", "w_rows"]
    launch = _launch("gemm_ws", "moe_gemm_ws_kernel", runtime, dict(GATED=True, TMA_STORE=False, num_warps=8))
    assert benchmark_script(SCRIPT).with_k(launch, 192).args[11] == 192


@pytest.mark.parametrize("module, name", [("gemm_wgmma", "moe_gemm_fp8_wgmma_kernel"),
                                          ("gemm_ws", "moe_gemm_fp8_ws_kernel")], ids=["wgmma", "ws"])
def test_the_fp8_kernels_k_is_replaced_by_name(module, name):
    """The fp8_block wgmma GEMMs, ws or not, are cut the same way: their K found among their arguments by name."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="needs Triton with Gluon")
    from moe.experts._triton import kernels

    fn = getattr(kernels(module), name)
    constexprs = {p.name: None for p in fn.params if p.is_constexpr}
    runtime = [n for n in fn.arg_names if n not in constexprs]
    assert "K" in runtime and "GATED" in constexprs
    cut = benchmark_script(SCRIPT).with_k(_launch(module, name, runtime, constexprs), 384)
    assert cut.args[runtime.index("K")] == 384
    assert [a for i, a in enumerate(cut.args) if i != runtime.index("K")] == [a for a in runtime if a != "K"]


def test_cut_ks_are_whole_k_steps_and_the_fit_finds_the_intercept():
    script = benchmark_script(SCRIPT)
    assert script.cut_ks(768, 64) == [192, 384, 768]
    assert script.cut_ks(2880, 64) == [704, 1408, 2880]
    assert script.cut_ks(100, 64) == [64, 64, 64]  # never below one step
    # 140 us that do not scale with K, 0.2 us per column of K
    assert script.fixed_part([(192, 178.4), (384, 216.8), (768, 293.6)]) == pytest.approx(140.0)
    with pytest.raises(ValueError, match="two different K"):
        script.fixed_part([(64, 1.0), (64, 2.0)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_the_script_says_so(capsys):
    assert benchmark_script(SCRIPT).main(["--preset", "qwen3-30b-a3b", "--tokens", "4096"]) == 2
    assert "needs an SM90+ CUDA GPU" in capsys.readouterr().err
