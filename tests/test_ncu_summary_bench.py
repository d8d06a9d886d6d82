"""benchmarks/ncu_summary.py on the Nsight Compute CSV session 37 committed (GPT-OSS-120B MXFP4's two decode GEMMs at
M = 64): the metrics and stall reasons of each kernel come out with ncu's values, and input that is not ncu's CSV is
refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import benchmark_script

CSV = Path(__file__).resolve().parents[1] / "benchmarks/results/fp4_gemv_s37_ncu_gpt-oss_mxfp4_m64_nvidia-h200.csv"


def test_each_kernels_metrics_and_stalls_as_ncu_printed_them():
    script = benchmark_script("ncu_summary")
    gemm1, gemm2 = script.read(CSV.read_text(), str(CSV))
    assert (gemm1["id"], gemm1["kernel"], gemm2["id"]) == ("0", "decode_gemm_kernel", "1")
    assert gemm1["metrics"]["Duration"] == ("397,568", "ns")
    assert gemm1["metrics"]["DRAM Throughput"] == ("61.65", "%")
    assert gemm1["metrics"]["Registers Per Thread"][0] == "80" and gemm2["metrics"]["Registers Per Thread"][0] == "55"
    assert max(gemm1["stalls"], key=gemm1["stalls"].get) == "long_scoreboard"
    assert gemm1["stalls"]["long_scoreboard"] == 29.49 and gemm2["stalls"]["not_selected"] == 26.78
    assert len(gemm1["stalls"]) == 16  # the 16 reasons that run passed to --metrics
    text = script.table([gemm1, gemm2])
    assert "| DRAM Throughput | 61.65 % | 57.01 % |" in text
    assert "long_scoreboard 29.5, not_selected 18.1" in text


def test_the_stall_metric_list_is_what_read_parses(capsys):
    script = benchmark_script("ncu_summary")
    assert script.main(["--stall-metrics"]) == 0
    names = capsys.readouterr().out.strip().split(",")
    assert len(names) == len(script.STALLS)
    rows = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'] + [
        f'"0","k","{name}","%","{i}.5"' for i, name in enumerate(names)]
    (kernel,) = script.read("\n".join(rows))
    assert kernel["stalls"] == {reason: i + 0.5 for i, reason in enumerate(script.STALLS)}


def test_json_output_and_input_that_is_not_ncus_csv(tmp_path, capsys):
    script = benchmark_script("ncu_summary")
    assert script.main([str(CSV), "--json"]) == 0
    assert [k["id"] for k in json.loads(capsys.readouterr().out)] == ["0", "1"]
    not_csv = tmp_path / "log.txt"
    not_csv.write_text("==PROF== Disconnected from process 1\n")
    assert script.main([str(not_csv)]) == 2
    assert f"{not_csv}: no ncu CSV rows (expected the output of ncu --csv --page details)" in capsys.readouterr().err
    assert script.main([str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err
