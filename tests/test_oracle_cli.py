"""``python -m moe plan``: the subcommand built by ``moe.tools.plan.add_plan_parser``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re

import pytest

from moe.tools.cli import main
from moe.errors import MoEConfigError
from moe.tools.plan import QUANT_NAMES, add_plan_parser

# imported here so that they register even before moe.experts imports them
BACKEND_MODULES = ("moe.experts.triton", "moe.experts.triton_batched", "moe.experts.flashinfer_cutlass",
                   "moe.experts.flashinfer_trtllm", "moe.experts.flashinfer_cutedsl")


def run(capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="python -m moe")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


@pytest.fixture
def backends():
    missing = [m for m in BACKEND_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"backend module not present: {', '.join(missing)}")
    for module in BACKEND_MODULES:
        importlib.import_module(module)


def test_json_is_exactly_one_object(capsys, backends):
    code, out = run(capsys, "--platform", "b200", "--preset", "deepseek-v3", "--quant", "nvfp4",
                    "--activation", "silu", "--tokens", "1", "64", "--json")
    data = json.loads(out)  # the whole output is one JSON document
    assert code == 0 and set(data) == {"plan", "rejected", "workspace_bytes", "platform", "slow_path"}
    assert data["platform"] == "b200" and isinstance(data["workspace_bytes"], int) and data["workspace_bytes"] > 0
    assert [row["tokens"] for row in data["plan"]] == [[1, 1], [2, 64]]
    for row in data["plan"]:
        assert set(row) == {"tokens", "experts", "prepare_finalize", "estimated_us", "slow_path", "shared_us", "layer_us"}
        assert row["layer_us"] > row["estimated_us"] and row["shared_us"] > 0  # deepseek-v3's shared expert
        assert row["slow_path"] is False
        assert row["experts"].startswith("flashinfer_") and row["prepare_finalize"] == "local"
    assert any("quant nvfp4" in r for r in data["rejected"]["torch_grouped"])


def test_explain_on_h100_says_why_each_flashinfer_nvfp4_backend_is_rejected(capsys, backends):
    code, out = run(capsys, "--platform", "h100", "--preset", "deepseek-v3", "--quant", "nvfp4",
                    "--activation", "silu", "--explain")
    assert code == 0
    for name in ("flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_cutedsl"):
        block = re.search(rf"^  experts\s+{name}\s+rejected:\n((?:      - .*\n?)+)", out, re.M)
        assert block and "SM100" in block.group(1), name
    assert re.search(r"^1\s+local \+ triton", out, re.M)  # weight-only: activations stay bf16
    assert re.search(r"M=1: roofline .*bf16\); triton", out)  # costed at the bf16 rate, not fp4


def test_without_flashinfer_and_without_triton(capsys, backends):
    _, out = run(capsys, "--platform", "h100", "--no-flashinfer", "--no-triton", "--preset", "qwen3-30b-a3b",
                 "--quant", "bf16", "--explain")
    assert "needs library 'flashinfer'" in out and "needs library 'triton'" in out
    assert re.search(r"^1\s+local \+ torch_grouped", out, re.M)


def test_explicit_shape_mxfp4_activations_and_expert_parallelism(capsys):
    _, out = run(capsys, "--platform", "cpu", "--experts", "8", "--top-k", "2", "--hidden", "64",
                 "--intermediate", "32", "--quant", "mxfp4", "--activation", "swiglu_oai", "--bias", "--explain")
    assert "quant=mxfp4 " in out and "bias=True" in out and "activation=swiglu_oai" in out
    _, out = run(capsys, "--platform", "cpu", "--experts", "8", "--top-k", "2", "--hidden", "64",
                 "--intermediate", "32", "--quant", "mxfp4", "--act-quant", "mxfp8", "--json")
    assert json.loads(out)["plan"][0]["experts"] == "reference"
    _, out = run(capsys, "--platform", "cpu", "--preset", "mixtral-8x7b", "--ep", "2", "--quant", "bf16", "--json")
    assert "ep_size=2" in " ".join(json.loads(out)["rejected"]["local"])


def test_nothing_can_serve_prints_the_reasons_and_exits_1(capsys, tmp_path):
    policy = tmp_path / "deny.yaml"
    policy.write_text("deny: [reference]\n")
    code, out = run(capsys, "--platform", "cpu", "--preset", "deepseek-v3", "--quant", "nvfp4", "--policy",
                    str(policy), "--explain")
    assert code == 1 and "no (prepare/finalize, experts) pair can serve" in out and "denied by policy" in out


@pytest.mark.parametrize("argv,match", [
    (("--preset", "deepseek-v3", "--experts", "8"), "--preset and --experts exclude each other"),
    (("--preset", "deepseek-v3", "--bias"), "--preset and --bias exclude each other"),  # was: --bias ignored
    (("--experts", "8", "--top-k", "2"), "missing --hidden, --intermediate"),
])
def test_shape_argument_errors(capsys, argv, match):
    with pytest.raises(MoEConfigError, match=match):
        run(capsys, "--platform", "cpu", *argv)


SHAPE = ("--experts", "8", "--top-k", "2", "--hidden", "64", "--intermediate", "32")


def with_value(flag: str, value: str) -> list[str]:
    """SHAPE with ``flag``'s value replaced (or ``flag value`` added)."""
    argv = list(SHAPE)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
        return argv
    return argv + [flag, value]


@pytest.mark.parametrize("flag", ["--experts", "--top-k", "--hidden", "--intermediate", "--ep", "--tokens",
                                  "--max-tokens"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_counts_must_be_positive(capsys, flag, value):
    """Was: ``--top-k 0`` said "missing --top-k"; ``--max-tokens 0`` planned for 8192 tokens."""
    assert main(["plan", "--platform", "cpu", *with_value(flag, value)]) == 2
    assert capsys.readouterr().err == f"python -m moe plan: error: argument {flag}: must be >= 1 (got {value})\n"


@pytest.mark.parametrize("argv,says", [
    # was: planned only up to 16, the --tokens 64 bucket silently dropped
    ([*SHAPE, "--tokens", "1", "64", "--max-tokens", "16"],
     "--max-tokens 16 is smaller than the largest --tokens 64; raise it or drop that bucket edge"),
    ([*SHAPE, "--ep", "3"], "--ep 3 must divide the number of experts E=8 (plan shards the experts evenly)"),
    ([*with_value("--top-k", "16")], "--top-k 16 is more than --experts 8: a token picks k distinct experts"),
    ([*SHAPE, "--act-quant", "mxfp8"], "--act-quant mxfp8 needs --quant mxfp4 (the scheme is bf16)"),
    ([*SHAPE, "--platform", "tpu"], "argument --platform: invalid choice: 'tpu' (choose from 'detect', 'cpu'"),
    (["--preset", "nosuch"], "argument --preset: invalid choice: 'nosuch' (choose from 'deepseek-v3'"),
    ([*SHAPE, "--activation", "tanh"], "argument --activation: invalid choice: 'tanh' (choose from 'silu'"),
    ([*SHAPE, "--quant", "int3"], "argument --quant: invalid choice: 'int3' (choose from 'bf16', 'fp16', 'fp32'"),
    ([*SHAPE, "--force", "nosuch"], "force names unknown backend(s) ['nosuch']"),
    ([*SHAPE, "--policy", "/no/such/policy.yaml"], "policy file '/no/such/policy.yaml' does not exist"),
    ([*SHAPE, "--policy", "/"], "policy file '/' is not a file"),  # was: "... does not exist"
])
def test_flag_errors_are_one_line(capsys, argv, says):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m moe plan: error: ") and says in err, err


def test_a_policy_file_that_is_not_yaml_is_one_line(capsys, tmp_path):
    """Was: a 60-line yaml.parser.ParserError traceback."""
    policy = tmp_path / "broken.yaml"
    policy.write_text("deny: [reference\n")
    assert main(["plan", "--platform", "cpu", *SHAPE, "--policy", str(policy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"policy file '{policy}' is not valid YAML at line 2: " in err, err


def test_every_scheme_name_is_a_quant_choice(capsys):
    """Was: fp32, unquantized and mxfp4_a_mxfp8 refused by plan, accepted by demo; one list serves both."""
    from moe.quant.scheme import SCHEME_NAMES

    assert QUANT_NAMES == SCHEME_NAMES
    for name in ("fp32", "unquantized", "mxfp4_a_mxfp8"):
        assert main(["plan", "--platform", "cpu", *SHAPE, "--quant", name, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["plan"]


@pytest.mark.parametrize("argv,kind,says", [
    # the example: was a traceback
    (SHAPE[:2] + ("--top-k", "16") + SHAPE[4:], "MoEConfigError", "--top-k 16 is more than --experts 8"),
    (("--preset", "mixtral-8x7b", "--force", "triton"), "UnsupportedError", "forces experts 'triton'"),
    (("--preset", "mixtral-8x7b", "--platform", "tpu"), "UsageError", "argument --platform: invalid choice: 'tpu'"),
    (("--preset", "mixtral-8x7b", "--tokens", "0"), "UsageError", "argument --tokens: must be >= 1 (got 0)"),
    (("--experts", "8"), "MoEConfigError", "missing --top-k, --hidden, --intermediate"),
    # was: --explain silently dropped
    (("--preset", "mixtral-8x7b", "--explain"), "MoEConfigError", "--explain does not go with --json"),
])
@pytest.mark.parametrize("json_flag", ["--json", "--js"])  # argparse takes an unambiguous prefix
def test_json_mode_errors_are_one_json_object(capsys, argv, kind, says, json_flag):
    assert main(["plan", "--platform", "cpu", *argv, json_flag]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]  # the whole of stdout is one JSON document
    assert captured.err == "" and set(error) == {"type", "message", "reasons"}
    assert error["type"] == kind and says in error["message"]
    if kind == "UnsupportedError":
        assert "needs library 'triton', which is not installed: pip install 'moe[triton]'" in error["reasons"]
        assert "\n" not in error["message"]  # the reasons are in their list, not repeated in the message


def test_explain_warns_when_only_reference_serves_a_gpu(capsys):
    assert main(["plan", "--platform", "h100", "--no-triton", "--preset", "deepseek-v3", "--quant", "mxfp8",
                 "--activation", "silu", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "slow path: no kernel serves mxfp8 on h100" in out and "SLOW PATH" in out
    assert main(["plan", "--platform", "b200", "--preset", "deepseek-v3", "--quant", "nvfp4",
                 "--activation", "silu", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "slow path" not in out and "SLOW PATH" not in out
