"""The measured profiles shipped in moe/oracle/profiles/: each is what benchmarks/make_measured_profile.py
makes of the committed bench results, and a plan on that platform follows its own measurements."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from moe.oracle import Policy, load_profile, plan
from moe.oracle.profile import PROFILE_DIR
from moe.platform import Platform
from moe.presets import load_preset
from tests.helpers import benchmark_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
H100_BENCH = ("bf16_qwen3_mixtral_nvidia-h100.json", "bf16_gpt-oss_deepseek_nvidia-h100.json",
              "mxfp4_gpt-oss-120b_nvidia-h100.json")


def _script():
    return benchmark_script("make_measured_profile")


def _cells(*names: str) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """(preset, scheme) -> M -> experts backend -> measured us, from committed bench result files in
    order (a later file's time of a backend replaces an earlier one's, as in the profile)."""
    cells: dict = defaultdict(lambda: defaultdict(dict))
    for name in names:
        for r in json.loads((RESULTS / name).read_text())["records"]:
            cells[(r["preset"], r["quant"])][r["tokens"]][r["experts"]] = r["us"]
    return cells


@pytest.mark.parametrize("machine", ["nvidia-h100", "nvidia-h200"])
def test_shipped_profile_is_what_the_script_makes_of_the_committed_results(machine):
    spec = _script().MACHINES[machine]
    shipped = load_profile(PROFILE_DIR / f"measured-{spec.kind}.yaml").entries
    assert shipped and all(e.platform == spec.kind and e.measured for e in shipped)
    made = {e.key(): e.measured_us for e in _script().measurements(spec)}  # later files replace earlier
    assert {e.key(): e.measured_us for e in shipped} == made


def test_h100_profile_holds_every_record_of_the_h100_bench_files_but_the_superseded():
    spec = _script().MACHINES["nvidia-h100"]
    shipped = load_profile(PROFILE_DIR / "measured-h100.yaml").entries
    last_file = {}  # (preset, scheme, M, backend) -> the last source file that measured it (it wins)
    for name in spec.sources:
        for r in json.loads((RESULTS / name).read_text())["records"]:
            if (r["experts"], r["quant"]) not in spec.superseded:
                last_file[(r["preset"], r["quant"], r["tokens"], r["experts"])] = name
    assert not {(e.backend, e.quant) for e in shipped} & set(spec.superseded)
    assert set(spec.sources) >= set(H100_BENCH) and len(shipped) == len(last_file)
    assert {e.note for e in shipped} == {f"benchmarks/results/{name}" for name in set(last_file.values())}


def test_a_source_read_for_some_schemes_only_leaves_the_others_to_earlier_files():
    """Session 19's fp8_block run has bf16 beside it but no FlashInfer: the H200 profile takes its fp8_block records
    and keeps the bf16 ones of the runs that timed FlashInfer beside them."""
    spec = _script().MACHINES["nvidia-h200"]
    name = "fp8_block_s19_bench_nvidia-h200.json"
    assert spec.sources[name][2] == ("fp8_block",)
    schemes = {r["quant"] for r in json.loads((RESULTS / name).read_text())["records"]}
    assert schemes == {"fp8_block", "bf16"}
    from_it = {e.quant for e in _script().measurements(spec) if e.note == f"benchmarks/results/{name}"}
    assert from_it == {"fp8_block"}
    shipped = load_profile(PROFILE_DIR / "measured-h200.yaml").entries
    assert {e.quant for e in shipped if e.note == f"benchmarks/results/{name}"} == {"fp8_block"}


def test_h100_plan_for_qwen3_decode_cites_an_h100_measurement_and_takes_its_fastest():
    """Qwen3-30B-A3B bf16 at M=1 on an H100: the plan reads measured-h100.yaml (not the H200 sibling)
    and picks the backend the committed H100 benches timed fastest (a later file's time replacing an earlier's)."""
    times = _cells(*_script().MACHINES["nvidia-h100"].sources)[("qwen3-30b-a3b", "bf16")][1]
    problem = load_preset("qwen3-30b-a3b").problem(quant="bf16", max_tokens=1)
    (bucket,) = plan(problem, Platform.preset("h100"), Policy(buckets=(1,))).buckets
    assert bucket.chosen.pair.experts == min(times, key=times.get)
    assert bucket.chosen.experts.basis == "measured at this shape (measured-h100.yaml)"
    assert bucket.chosen.experts.us == pytest.approx(times[bucket.chosen.pair.experts])


@pytest.mark.parametrize("name", H100_BENCH)
def test_h100_plan_takes_the_measured_fastest_in_every_bench_cell(name):
    """Every cell of the file, with the times the profile holds (a later source file's replace its)."""
    spec = _script().MACHINES["nvidia-h100"]
    merged = _cells(*spec.sources)
    for (preset, quant), by_tokens in _cells(name).items():
        tokens = sorted(by_tokens)
        problem = load_preset(preset).problem(quant=quant, max_tokens=tokens[-1])
        result = plan(problem, Platform.preset("h100"), Policy(buckets=tuple(tokens)))
        for bucket in result.buckets:
            times = {b: us for b, us in merged[(preset, quant)][bucket.high].items()
                     if (b, quant) not in spec.superseded}
            if (bucket.chosen.pair.experts, quant) in spec.superseded:  # ranked by the H200's measurement
                assert "measured-h200.yaml" in bucket.chosen.experts.basis
                continue
            assert bucket.chosen.pair.experts == min(times, key=times.get), (preset, quant, bucket.high, times)
            assert "measured-h100.yaml" in bucket.chosen.experts.basis


def test_h200_plan_still_cites_the_h200_measurements():
    problem = load_preset("qwen3-30b-a3b").problem(quant="bf16", max_tokens=4096)
    result = plan(problem, Platform.preset("h200"), Policy(buckets=(1, 64, 4096)))
    for bucket in result.buckets:
        assert bucket.chosen.experts.basis == "measured at this shape (measured-h200.yaml)", bucket.high


def test_h100_plan_for_a_superseded_scheme_reads_the_h200_measurement_scaled_to_the_h100():
    """Triton MXFP4 on an H100: its H100 records predate the decode kernels' rewrite (`superseded`), so the plan
    takes the H200's measurement of the same cell as an efficiency and scales it by the H100's ceilings (memory
    bound at M = 1: the bandwidths' ratio)."""
    assert ("triton", "mxfp4") in _script().MACHINES["nvidia-h100"].superseded
    (h200_us,) = [e.measured_us for e in load_profile(PROFILE_DIR / "measured-h200.yaml").entries
                  if (e.backend, e.quant, e.tokens, e.shape.preset) == ("triton", "mxfp4", 1, "gpt-oss-120b")]
    problem = load_preset("gpt-oss-120b").problem(quant="mxfp4", max_tokens=1)
    h100, h200 = Platform.preset("h100"), Platform.preset("h200")
    (bucket,) = plan(problem, h100, Policy(buckets=(1,))).buckets
    assert bucket.chosen.pair.experts == "triton"
    assert bucket.chosen.experts.basis == "measured on h200 at this shape, against its ceilings (measured-h200.yaml)"
    assert bucket.chosen.experts.us == pytest.approx(h200_us * h200.memory_bandwidth / h100.memory_bandwidth)
