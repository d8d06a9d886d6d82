"""``python -m moe``: the demo and its check, and how every subcommand refuses bad flags."""

import json
import re
import subprocess
import sys

import pytest
import torch

from moe.tools import ep_demo
from moe.tools.cli import backends_table, main
from moe.tools.demo import dequantize_then_compute
from moe.errors import UnsupportedError
from moe.experts.reference import ReferenceExperts
from moe.kernel import ModularKernel
from moe.prepare_finalize import LocalPrepareFinalize
from moe.problem import MoEProblem, ParallelConfig
from moe.registry import experts_classes, prepare_finalize_classes
from moe.router import TopK
from moe.tolerance import TOLERANCES, regime_for, relative_error
from moe.weights import ExpertWeights


def one_error_line(capsys, argv, command: str) -> str:
    """Runs ``python -m moe ARGV`` in-process; asserts exit 2 and one ``error:`` line on stderr; returns it."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(" ".join(["python -m moe", command][: 2 if command else 1]) + ": error: "), err
    return err


# --- the demo and its check --------------------------------------------------------------------------
def test_demo_runs_and_checks_against_a_float32_loop(capsys):
    assert main(["demo", "--preset", "mixtral-8x7b", "--tokens", "9"]) == 0
    out = capsys.readouterr().out
    assert "scaled down from E=8, H=4096, I=14336" in out
    assert "ModularKernel(local + torch_grouped)" in out
    assert "vs an independent float32 loop" in out and "-> OK" in out and "workspace" in out and "ms median" in out


@pytest.mark.parametrize("preset,quant",
                         [("gpt-oss-20b", "mxfp4"), ("deepseek-v3", "fp8_block"), ("nemotron-h", "bf16")])
def test_demo_other_presets(capsys, preset, quant):
    assert main(["demo", "--preset", preset, "--tokens", "3", "--quant", quant]) == 0
    assert "-> OK" in capsys.readouterr().out


def test_demo_nvfp4_on_cpu_runs_reference_and_says_it_is_checked_independently(capsys):
    assert main(["demo", "--quant", "nvfp4", "--tokens", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "ModularKernel(local + reference)" in out
    assert "the layer runs the reference experts itself (nothing faster serves nvfp4 on cpu)" in out
    assert "checked against an independent float32 loop, not against itself" in out
    error = float(re.search(r"relative error (\S+) \(bound 1e-01, fp4\) -> OK", out).group(1))
    assert error > 0  # a different computation: the bf16 output rounds differently from the float32 loop


def test_demo_check_fails_when_the_layer_is_wrong(capsys, monkeypatch):
    """The old demo compared ``local + reference`` with ``reference``: a wrong reference passed."""
    compute = ReferenceExperts._compute
    monkeypatch.setattr(ReferenceExperts, "_compute", lambda self, *a: 1.2 * compute(self, *a))
    assert main(["demo", "--quant", "nvfp4", "--tokens", "5", "--device", "cpu"]) == 1
    assert re.search(r"relative error 2\.\d+e-01 \(bound 1e-01, fp4\) -> FAIL", capsys.readouterr().out)


def test_demo_with_no_tokens_says_there_is_nothing_to_compare(capsys):
    assert main(["demo", "--tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "check       none: M=0 gives no values to compare" in out and "relative error" not in out


def test_demo_unquantized_scheme_names_the_dtype(capsys):
    assert main(["demo", "--quant", "fp16", "--tokens", "3"]) == 0  # was: quant='fp16' ... but dtype=bfloat16
    out = capsys.readouterr().out
    assert "quant=fp16 dtype=float16" in out and "(bound 5e-03, fp16) -> OK" in out


def test_float32_loop_closed_form():
    """relu2 with w13 = c_e * Identity and w2 = Identity: token t's output is
    sum_k weight * (relu(c_e x_t)^2 + b2_e), with no backend involved."""
    p = MoEProblem.create(num_experts=2, top_k=2, hidden_size=32, intermediate_size=32, activation="relu2",
                          quant="fp32", has_bias=True)
    eye, scale = torch.eye(32), torch.tensor([1.0, -2.0])
    b2 = torch.randn(2, 32)
    weights = ExpertWeights.from_dense(scale[:, None, None] * eye, eye.expand(2, 32, 32).clone(),
                                       torch.zeros(2, 32), b2, quant="fp32", dtype=torch.float32)
    x = torch.randn(3, 32)
    topk = TopK(torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32), torch.tensor([[0.7, 0.3], [0.6, 0.4],
                                                                                          [1.0, 0.0]]))
    expected = torch.stack([
        sum(w * (torch.relu(scale[e] * x[t]) ** 2 + b2[e]) for e, w in zip(topk.ids[t].tolist(), topk.weights[t]))
        for t in range(3)])
    assert torch.allclose(dequantize_then_compute(p, weights, x, topk), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("quant", ["bf16", "fp8", "fp8_block", "mxfp4", "mxfp4_a_mxfp8", "nvfp4"])
def test_float32_loop_agrees_with_the_reference_experts(quant):
    """Two independent computations of the same layer agree within the scheme's regime."""
    p = MoEProblem.create(num_experts=8, top_k=3, hidden_size=128, intermediate_size=128, activation="swiglu_oai",
                          quant=quant, has_bias=True, max_tokens=11)
    weights = ep_demo.random_layer(p, seed=0)
    hidden, topk = ep_demo.random_tokens(p, 11, seed=1)
    kernel = ModularKernel(LocalPrepareFinalize(p), ReferenceExperts(p))
    kernel.load(weights)
    out = kernel.forward(hidden, topk)
    assert relative_error(out, dequantize_then_compute(p, weights, hidden, topk)) <= TOLERANCES[regime_for(p)]


def test_backends_table_lists_every_registered_backend():
    table = backends_table()
    for name in list(experts_classes()) + list(prepare_finalize_classes()):
        assert f"| {name} |" in table


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "moe", "backends"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "| reference |" in result.stdout


def test_the_command_line_does_not_import_the_test_kit():
    code = ("import sys, moe.tools.cli, moe.tools.demo, moe.tools.ep_demo; "
            "print(sorted(m for m in sys.modules if m.startswith('moe.testing')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


# --- the expert-parallel demo ------------------------------------------------------------------------
def test_demo_expert_parallel_two_processes(capsys):
    assert main(["demo", "--ep", "2", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "2 CPU processes (gloo)" in out
    assert ("all_to_all          + reference      sharded vs unsharded: max |difference| 0.000e+00 "
            "(must be exact) -> OK") in out
    assert out.count("vs float32 loop: relative") == 3 and "FAIL" not in out


def test_demo_expert_parallel_nvfp4_skips_what_cannot_serve_and_says_what_it_cannot_check(capsys):
    """Was: every rank failed with a traceback (torch_grouped cannot serve nvfp4)."""
    assert main(["demo", "--ep", "2", "--tokens", "2", "--quant", "nvfp4", "--preset", "mixtral-8x7b"]) == 0
    out = capsys.readouterr().out
    assert "all_to_all          + torch_grouped  skipped: cannot serve quant=nvfp4 (quant nvfp4×nvfp4" in out
    assert out.count("vs float32 loop: no independent check (nvfp4 activations are scaled per tensor") == 2
    assert "must be exact" not in out  # each rank rounds its own rows: sharded and unsharded differ


def test_expert_parallel_demo_gets_every_flag(monkeypatch):
    calls = []
    monkeypatch.setattr(ep_demo, "run_ep_demo", lambda *a, **k: calls.append((a, k)) or 0)
    assert main(["demo", "--ep", "2", "--experts", "torch_grouped", "--quant", "fp16", "--tokens", "5",
                 "--preset", "mixtral-8x7b", "--device", "cpu"]) == 0
    assert calls == [((2, "mixtral-8x7b", 5, "fp16"), {"experts": "torch_grouped"})]


def test_expert_parallel_demo_pairs_honour_experts():
    bf16 = MoEProblem.create(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, quant="bf16",
                             parallel=ParallelConfig(2, 0))
    assert ep_demo.demo_pairs(bf16, "torch_grouped") == ([("all_to_all", "torch_grouped")], {})
    assert ep_demo.demo_pairs(bf16, "reference") == (
        [("all_to_all", "reference"), ("all_to_all_batched", "reference")], {})
    assert ep_demo.demo_pairs(bf16, None) == (list(ep_demo.DEMO_PAIRS), {})
    nvfp4 = MoEProblem.create(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, quant="nvfp4",
                              parallel=ParallelConfig(2, 0))
    pairs, skipped = ep_demo.demo_pairs(nvfp4, None)
    assert ("all_to_all", "torch_grouped") not in pairs and "nvfp4" in skipped[("all_to_all", "torch_grouped")][0]
    with pytest.raises(UnsupportedError, match="--experts torch_grouped cannot serve"):
        ep_demo.demo_pairs(nvfp4, "torch_grouped")


# --- one line for every configuration error ------------------------------------------------------------
@pytest.mark.parametrize("argv,says", [
    (["--ep", "0"], "argument --ep: must be >= 1 (got 0)"),  # was: ran the single-process demo, exit 0
    (["--ep", "-2"], "argument --ep: must be >= 1 (got -2)"),
    (["--ep", "3"], "--ep must be an int >= 2 dividing the (scaled) E=32 (got 3); choose from 2, 4, 8, 16, 32"),
    (["--tokens", "-1"], "argument --tokens: must be >= 0 (got -1)"),
    (["--tokens", "many"], "argument --tokens: must be an int >= 0 (got 'many')"),
    (["--preset", "no-such-model"], "argument --preset: invalid choice: 'no-such-model' (choose from 'deepseek-v3'"),
    (["--quant", "int3"], "argument --quant: invalid choice: 'int3' (choose from 'bf16', 'fp16', 'fp32'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu' (choose from 'cpu', 'cuda')"),
    (["--experts", "nosuch"], "--experts: unknown experts backend 'nosuch'; choose from reference, torch_grouped"),
    # was: --experts and --device ignored under --ep
    (["--ep", "2", "--experts", "nosuch", "--device", "cpu"], "--experts: unknown experts backend 'nosuch'"),
    (["--ep", "2", "--full-size"], "--full-size does not go with --ep 2"),
    (["--ep", "2", "--tokens", "0"], "--tokens 0 does not go with --ep 2"),
    (["--experts", "flashinfer_cutlass", "--device", "cpu", "--tokens", "2"],
     "forces experts 'flashinfer_cutlass', which cannot serve this problem on cpu: runs on ['cuda'], not cpu"),
])
def test_demo_flag_errors_are_one_line(capsys, argv, says):
    assert says in one_error_line(capsys, ["demo", *argv], "demo")


def test_demo_full_size_beyond_the_machines_memory_is_refused(capsys, monkeypatch):
    """Was: drew 45 GB of float32 weights for deepseek-v3 --full-size, swapping or killed."""
    monkeypatch.setattr("moe.tools.demo.host_memory_bytes", lambda: 16 * 10**9)
    err = one_error_line(capsys, ["demo", "--preset", "deepseek-v3", "--full-size", "--device", "cpu"], "demo")
    assert err.endswith("the deepseek-v3 layer's weights take 45.1 GB in float32 as the demo draws them, more than "
                        "this machine's 16.0 GB of memory; drop --full-size or choose a smaller --preset")


def test_demo_device_cuda_without_cuda_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["demo", "--device", "cuda"], ["demo", "--ep", "2", "--device", "cuda"]):
        assert one_error_line(capsys, argv, "demo").endswith("error: --device cuda: no CUDA device on this machine")


def test_demo_device_cuda_with_expert_parallelism_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    err = one_error_line(capsys, ["demo", "--ep", "2", "--device", "cuda"], "demo")
    assert "--device cuda does not go with --ep 2: the expert-parallel demo runs 2 CPU processes" in err


def test_several_reasons_are_listed_below_the_message(capsys):
    argv = ["plan", "--platform", "cpu", "--preset", "mixtral-8x7b", "--force", "triton"]
    assert main(argv) == 2
    first, *reasons = capsys.readouterr().err.strip().split("\n")
    assert first == ("python -m moe plan: error: policy (--force) forces experts 'triton', which cannot serve "
                     "this problem on cpu")
    assert len(reasons) >= 2 and all(r.startswith("  - ") for r in reasons)


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(*args):
        raise RuntimeError("a bug, not a configuration error")

    monkeypatch.setattr("moe.tools.cli.run_demo", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["demo"])


@pytest.mark.parametrize("argv,says", [
    (["bench", "--tokens", "abc"], "argument --tokens: must be an int >= 1 (got 'abc')"),
    (["bench", "--tokens", "16,0"], "argument --tokens: must be >= 1 (got 0)"),
    (["bench", "--preset", "qwen3-30b-a3b,nosuch"],
     "argument --preset: unknown preset 'nosuch'; choose from deepseek-v3"),
    (["bench", "--quant", "int3"], "argument --quant: unknown scheme 'int3'; choose from bf16"),
    (["bench", "--experts", "triton,nosuch"],
     "--experts: unknown experts backend(s) ['nosuch']; choose from reference"),
    (["bench", "--rotations", "0"], "argument --rotations: must be >= 1 (got 0)"),
    (["bench", "--json", "/no/such/folder/r.json"],
     "--json /no/such/folder/r.json: the folder /no/such/folder does not exist"),
    (["tune"], "the following arguments are required: --preset"),
    (["tune", "--preset", "nosuch"], "argument --preset: unknown preset 'nosuch'"),
    (["tune", "--preset", "qwen3-30b-a3b", "--tokens", "0"], "argument --tokens: must be >= 1 (got 0)"),
    (["tune", "--preset", "qwen3-30b-a3b", "--workers", "0"], "argument --workers: must be >= 1 (got 0)"),
])
def test_bench_and_tune_flag_errors_are_one_line_before_any_gpu_work(capsys, argv, says):
    assert says in one_error_line(capsys, argv, argv[0])


def test_tune_refuses_what_the_triton_experts_cannot_serve_before_any_gpu_work(capsys, monkeypatch):
    """Every preset and scheme has a Triton mode today (nvfp4, then mxfp8, were the example until their
    weight-only modes), so the refusal is shown with a check that refuses: what a scheme added later
    without a Triton mode would meet."""
    from moe.experts.triton import TritonExperts

    monkeypatch.setattr(TritonExperts, "check", classmethod(lambda cls, problem, platform: ["quant mxfp8×mxfp8"]))
    err = one_error_line(capsys, ["tune", "--preset", "qwen3-30b-a3b", "--quant", "mxfp8"], "tune")
    assert "--preset qwen3-30b-a3b --quant mxfp8: the Triton experts cannot serve it: quant mxfp8×mxfp8" in err


def test_tune_out_must_be_a_folder(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    err = one_error_line(capsys, ["tune", "--preset", "qwen3-30b-a3b", "--out", str(tmp_path / "file")], "tune")
    assert "exists and is not a folder" in err


def test_bench_plot_without_matplotlib_is_refused_before_measuring(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert "--plot out.png: needs matplotlib" in one_error_line(capsys, ["bench", "--plot", "out.png"], "bench")


@pytest.mark.parametrize("command", ["bench", "tune", "tune --refine"])
def test_bench_and_tune_without_a_gpu_say_so_in_one_line(capsys, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    command, *flags = command.split()
    argv = [command, *flags, "--tokens", "1"] + (["--preset", "qwen3-30b-a3b"] if command == "tune" else [])
    assert one_error_line(capsys, argv, command).endswith("needs a CUDA GPU, and torch finds none on this machine")


def test_unknown_command_is_one_line(capsys):
    assert "argument command: invalid choice: 'nosuch'" in one_error_line(capsys, ["nosuch"], "")


def test_exit_codes_in_a_real_process():
    demo = subprocess.run([sys.executable, "-m", "moe", "demo", "--ep", "0"], capture_output=True, text=True,
                          timeout=120)
    assert demo.returncode == 2 and demo.stdout == ""
    assert demo.stderr == "python -m moe demo: error: argument --ep: must be >= 1 (got 0)\n"
    plan = subprocess.run([sys.executable, "-m", "moe", "plan", "--experts", "8", "--top-k", "16", "--hidden", "64",
                           "--intermediate", "32", "--json"], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 2 and plan.stderr == ""
    assert json.loads(plan.stdout)["error"]["message"] == (
        "--top-k 16 is more than --experts 8: a token picks k distinct experts")
