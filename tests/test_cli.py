import subprocess
import sys

import pytest

from moe.cli import backends_table, main
from moe.registry import experts_classes, prepare_finalize_classes


def test_demo_runs_and_checks_against_reference(capsys):
    assert main(["demo", "--preset", "mixtral-8x7b", "--tokens", "9"]) == 0
    out = capsys.readouterr().out
    assert "scaled down from E=8, H=4096, I=14336" in out
    assert "ModularKernel(local + torch_grouped)" in out
    assert "-> OK" in out and "workspace" in out and "ms median" in out


@pytest.mark.parametrize("preset,quant", [("gpt-oss-20b", "mxfp4"), ("deepseek-v3", "fp8_block"), ("nemotron-h", "bf16")])
def test_demo_other_presets(capsys, preset, quant):
    assert main(["demo", "--preset", preset, "--tokens", "3", "--quant", quant]) == 0
    assert "-> OK" in capsys.readouterr().out


def test_backends_table_lists_every_registered_backend():
    table = backends_table()
    for name in list(experts_classes()) + list(prepare_finalize_classes()):
        assert f"| {name} |" in table


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "moe", "backends"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "| reference |" in result.stdout


def test_unknown_preset_is_a_clear_error():
    from moe import MoEConfigError

    with pytest.raises(MoEConfigError, match="no-such-model"):
        main(["demo", "--preset", "no-such-model"])


def test_demo_expert_parallel_two_processes(capsys):
    assert main(["demo", "--ep", "2", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "2 CPU processes (gloo)" in out and "must be exact -> OK" in out
