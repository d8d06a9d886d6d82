"""benchmarks/decode_ablation.py on a CPU: every variant's edits find the source they replace (once), so a kernel
change cannot leave a variant timing the unchanged kernel under its name; the edited kernels still run (Triton's
interpreter, one token); and the script's refusals name what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import benchmark_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    return benchmark_script("decode_ablation")


def test_every_variant_edits_the_current_kernels(script, tmp_path):
    for name, (_, edits) in script.VARIANTS.items():
        copy = script.build(name, tmp_path)
        for path, old, new in edits:
            text = (copy / path).read_text()
            assert new in text and old not in text, (name, path)
        named = {path for path, _, _ in edits}
        for file in (copy / "moe").rglob("*.py"):  # the rest of the copy is this checkout's
            path = str(file.relative_to(copy))
            if path not in named:
                assert file.read_bytes() == (ROOT / path).read_bytes(), (name, path)
    assert {"base", "no_gemm1_finish", "no_gemm2_finish", "fp8_loop_only"} <= set(script.VARIANTS)


def test_an_edit_whose_source_is_gone_fails_the_build(script, tmp_path, monkeypatch):
    monkeypatch.setitem(script.VARIANTS, "stale", ("nothing", [(script._DECODE, "no such line\n", "x\n")]))
    with pytest.raises(RuntimeError, match="'stale'.*0 times, not once; the kernel changed"):
        script.build("stale", tmp_path)


def test_an_unknown_variant_is_named(script, tmp_path):
    with pytest.raises(SystemExit, match="--variants: unknown variant 'nope'"):
        script.build("nope", tmp_path)
    with pytest.raises(SystemExit, match="--variants: unknown variant 'nope'"):  # before it asks for a GPU
        script.main(["--variants", "base,nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's check")
@pytest.mark.parametrize("name", ["fp8_loop_only", "no_gemm1_finish"])
def test_the_edited_kernels_run(script, tmp_path, name):
    """One token through the fp8 TMA decode tiles that finish their epilogues, with the copy's `moe` (the test
    helpers from this checkout): the edits keep the kernels valid Triton."""
    copy = script.build(name, tmp_path)
    code = ("import sys, os; sys.path[:0] = [os.getcwd(), sys.argv[1]]\n"
            "import moe; assert moe.__file__.startswith(os.getcwd()), moe.__file__\n"
            "from tests.test_triton_compiles_for_gpu import decode, TMA_FINISH_TILES\n"
            "decode(1, TMA_FINISH_TILES, activation='silu', quant='fp8_block')\n"
            "print('ran')\n")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=copy, capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=""), timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ran"), done.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_without_a_gpu_the_script_says_so(script, capsys):
    assert script.main(["--cases", "qwen3-30b-a3b:fp8_block"]) == 1
    assert "on a CUDA GPU; none is available here" in capsys.readouterr().out


def test_replot_draws_saved_runs_side_by_side(script, tmp_path):
    """``--replot`` needs no GPU: the saved runs' cases, one panel each, from their ``best`` times."""
    pytest.importorskip("matplotlib")
    import json

    saved = []
    for i, case in enumerate(("qwen3-30b-a3b:fp8_block", "qwen3-30b-a3b:nvfp4")):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps({"best": {"base": {case: 18.0}, "no_finish": {case: 16.0 - i}}}))
        saved.append(str(path))
    png = tmp_path / "ablation.png"
    assert script.main(["--replot", ",".join(saved), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="--replot draws into --plot PATH"):
        script.main(["--replot", saved[0]])
