"""benchmarks/transformers_families.py on families of the installed transformers: one moe serves (Qwen3-MoE), one whose
experts module wraps the decorated projections (Ergo), one that takes top-1 only (ZAYA), one whose tiny model
transformers itself cannot build (Qwen4-exp); a match where the experts do not move the logits is "unchecked", a
family moe breaks is a failure, and bad arguments are refused naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import benchmark_script

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def test_served_families_match_eager_and_a_config_error_is_not_moes():
    script = benchmark_script("transformers_families")
    assert {"qwen3_moe", "mixtral", "gpt_oss", "ergo"} <= set(script.families())
    qwen3, ergo = script.check("qwen3_moe"), script.check("ergo")
    assert (qwen3.status, qwen3.modules) == ("served", 2) and qwen3.relative_error <= script.TOLERANCE
    assert "ModularKernel(local + torch_grouped)" in qwen3.detail
    assert ergo.status == "served" and ergo.relative_error <= script.TOLERANCE
    if "zaya" in script.families():  # transformers 5.25: top-1 only, which FAMILY_FIELDS gives it
        zaya = script.check("zaya")
        assert zaya.status == "served" and zaya.relative_error <= script.TOLERANCE
        broken = script.check("qwen4_exp")  # a default of None its own model divides by
        assert broken.status == "not built" and broken.detail.startswith("config: TypeError")
    assert script.check("qwen3_moe", max_params=1000).status == "skipped"


def test_a_match_counts_only_where_the_experts_move_the_logits(monkeypatch):
    script = benchmark_script("transformers_families")
    served = script.check("mixtral")
    assert served.status == "served" and served.influence >= script.INFLUENCE
    monkeypatch.setattr(script, "INFLUENCE", 10 * served.influence)  # as if zeroing the experts changed too little
    unchecked = script.check("mixtral")
    assert unchecked.status == "unchecked" and unchecked.detail.startswith("the experts move the logits by")


def test_a_family_moe_breaks_is_a_failure_and_sets_the_exit_status(monkeypatch, tmp_path, capsys):
    from moe.integrations._binding import Binding

    script = benchmark_script("transformers_families")

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel bug")

    monkeypatch.setattr(Binding, "run", broken)
    result = script.check("mixtral")
    assert (result.status, result.detail) == ("failed", "moe: RuntimeError: a kernel bug")
    out = tmp_path / "r.json"
    assert script.main(["--family", "mixtral", "--json", str(out)]) == 1
    saved = json.loads(out.read_text())
    assert saved["transformers"] == transformers.__version__ and saved["results"][0]["status"] == "failed"
    assert "| mixtral | failed |" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [(["--family", "llama"], "--family: ['llama'] are not MoE families"),
                                          (["--max-params", "0"], "--max-params must be >= 1 (got 0)")])
def test_bad_arguments_are_refused_naming_them(argv, message, capsys):
    assert benchmark_script("transformers_families").main(argv) == 2
    assert message in capsys.readouterr().err


def test_every_family_the_committed_run_served_is_still_served():
    """The committed run (results/transformers_families_cpu.json) against this tree, for the transformers it ran on:
    a family that stops being served, or starts failing, is a regression of the integration (about 10 s)."""
    script = benchmark_script("transformers_families")
    committed = json.loads((ROOT / "benchmarks/results/transformers_families_cpu.json").read_text())
    if committed["transformers"] != transformers.__version__:
        pytest.skip(f"the committed run is of transformers {committed['transformers']}")
    served = [r["family"] for r in committed["results"] if r["status"] == "served"]
    assert len(served) >= 40
    now = {family: script.check(family) for family in served}
    assert {f: (r.status, r.detail) for f, r in now.items() if r.status != "served"} == {}
