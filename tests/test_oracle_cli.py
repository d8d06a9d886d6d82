"""``python -m moe plan``: the subcommand built by ``moe.oracle.cli.add_plan_parser``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re

import pytest

from moe.oracle.cli import add_plan_parser

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
        assert set(row) == {"tokens", "experts", "prepare_finalize", "estimated_us", "slow_path"}
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
    assert re.search(r"^1\s+local \+ reference", out, re.M)


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
    (("--preset", "deepseek-v3", "--experts", "8"), "exclude each other"),
    (("--experts", "8", "--top-k", "2"), "missing --hidden, --intermediate"),
])
def test_shape_argument_errors(capsys, argv, match):
    with pytest.raises(SystemExit, match=match):
        run(capsys, "--platform", "cpu", *argv)


def test_explain_warns_when_only_reference_serves_a_gpu(capsys):
    from moe.cli import main

    assert main(["plan", "--platform", "h100", "--preset", "deepseek-v3", "--quant", "nvfp4",
                 "--activation", "silu", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "slow path: no kernel serves nvfp4 on h100" in out and "SLOW PATH" in out
    assert main(["plan", "--platform", "b200", "--preset", "deepseek-v3", "--quant", "nvfp4",
                 "--activation", "silu", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "slow path" not in out and "SLOW PATH" not in out
