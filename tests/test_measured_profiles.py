"""The measured profiles shipped in moe/oracle/profiles/: each is what benchmarks/make_measured_profile.py
makes of the committed bench results, and a plan on that platform follows its own measurements."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import pytest

from moe.oracle import Policy, load_profile, plan
from moe.oracle.cost import efficiency_at
from moe.oracle.profile import PROFILE_DIR, Profile, ProfileEntry, ProfileShape
from moe.platform import Platform
from moe.presets import load_preset
from tests.helpers import benchmark_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
H100_BENCH = ("bf16_qwen3_mixtral_nvidia-h100.json", "bf16_gpt-oss_deepseek_nvidia-h100.json",
              "mxfp4_gpt-oss-120b_nvidia-h100.json")


def _script():
    return benchmark_script("make_measured_profile")


def _read(machine: str):
    """(file, record) for each record of the machine's source files that its profile may take, in file order:
    a superseded (backend, scheme)'s records only from the file that re-measured them on (`remeasured_from`)."""
    spec = _script().MACHINES[machine]
    stale_sources = set(spec.stale_sources)
    for name in spec.sources:
        for r in json.loads((RESULTS / name).read_text())["records"]:
            if name not in stale_sources or (r["experts"], r["quant"]) not in spec.superseded:
                yield name, r


def _cells(machine: str) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """(preset, scheme) -> M -> experts backend -> measured us, from the machine's committed bench result files in
    order (a later file's time of a backend replaces an earlier one's, as in the profile)."""
    cells: dict = defaultdict(lambda: defaultdict(dict))
    for _, r in _read(machine):
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
    for name, r in _read("nvidia-h100"):
        last_file[(r["preset"], r["quant"], r["tokens"], r["experts"])] = name
    stale = {f"benchmarks/results/{name}" for name in spec.stale_sources}
    assert not [e for e in shipped if (e.backend, e.quant) in spec.superseded and e.note in stale]
    assert set(spec.sources) >= set(H100_BENCH) and len(shipped) == len(last_file)
    assert {e.note for e in shipped} == {f"benchmarks/results/{name}" for name in set(last_file.values())}


def test_superseded_records_stay_out_only_of_the_files_before_the_remeasurement(tmp_path, monkeypatch):
    """Once a machine is lent again, its new file's records of a superseded kernel are read, and the older files'
    records of it stay out even at token counts the new file did not time; other backends' old records stay in."""
    script = _script()
    record = {"preset": "qwen3-30b-a3b", "quant": "bf16"}
    old = [{**record, "experts": "triton", "tokens": m, "us": 100.0 * m} for m in (1, 256)]
    old.append({**record, "experts": "flashinfer_cutlass", "tokens": 256, "us": 90.0})
    (tmp_path / "old.json").write_text(json.dumps({"records": old}))
    (tmp_path / "new.json").write_text(json.dumps({"records": [{**record, "experts": "triton", "tokens": 1,
                                                                "us": 50.0}]}))
    monkeypatch.setattr(script, "RESULTS", tmp_path)
    sources = {"old.json": ("records", None), "new.json": ("records", None)}
    machine = script.Machine("h100", sources, "test", superseded={("triton", "bf16"): "rewritten"},
                             remeasured_from="new.json")
    read = {(e.backend, e.tokens, e.note) for e in script.measurements(machine)}
    assert read == {("flashinfer_cutlass", 256, "benchmarks/results/old.json"),
                    ("triton", 1, "benchmarks/results/new.json")}
    assert machine.stale_sources == ["old.json"]
    never_remeasured = dataclasses.replace(machine, remeasured_from=None)
    assert never_remeasured.stale_sources == ["old.json", "new.json"]
    assert {(e.backend, e.tokens) for e in script.measurements(never_remeasured)} == {("flashinfer_cutlass", 256)}
    with pytest.raises(ValueError, match="remeasured_from='nwe.json': must name one of this machine's sources"):
        dataclasses.replace(machine, remeasured_from="nwe.json")


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
    times = _cells("nvidia-h100")[("qwen3-30b-a3b", "bf16")][1]
    assert "triton" in times  # session 42's re-measurement
    problem = load_preset("qwen3-30b-a3b").problem(quant="bf16", max_tokens=1)
    (bucket,) = plan(problem, Platform.preset("h100"), Policy(buckets=(1,))).buckets
    assert bucket.chosen.pair.experts == min(times, key=times.get)
    assert bucket.chosen.experts.basis == "measured at this shape (measured-h100.yaml)"
    assert bucket.chosen.experts.us == pytest.approx(times[bucket.chosen.pair.experts])


@pytest.mark.parametrize("name", H100_BENCH)
def test_h100_plan_takes_the_measured_fastest_in_every_bench_cell(name):
    """Every cell of the file, with the times the profile holds (a later source file's replace its). A backend
    the H100 has no current time of at a cell (a superseded kernel not re-timed there) ranks by an estimate, and
    is chosen only where that estimate beats every measured time."""
    merged = _cells("nvidia-h100")
    cells = json.loads((RESULTS / name).read_text())["records"]
    for preset, quant in {(r["preset"], r["quant"]) for r in cells}:
        tokens = sorted({r["tokens"] for r in cells if (r["preset"], r["quant"]) == (preset, quant)})
        problem = load_preset(preset).problem(quant=quant, max_tokens=tokens[-1])
        result = plan(problem, Platform.preset("h100"), Policy(buckets=tuple(tokens)))
        for bucket in result.buckets:
            times = merged[(preset, quant)][bucket.high]
            chosen = bucket.chosen
            if chosen.pair.experts in times:
                assert chosen.pair.experts == min(times, key=times.get), (preset, quant, bucket.high, times)
                assert chosen.experts.basis == "measured at this shape (measured-h100.yaml)"
            else:  # estimated (from this shape's other token counts, other shapes or the H200's measurements)
                assert chosen.experts.us < min(times.values()), (preset, quant, bucket.high, times)


def test_h200_plan_still_cites_the_h200_measurements():
    problem = load_preset("qwen3-30b-a3b").problem(quant="bf16", max_tokens=4096)
    result = plan(problem, Platform.preset("h200"), Policy(buckets=(1, 64, 4096)))
    for bucket in result.buckets:
        assert bucket.chosen.experts.basis == "measured at this shape (measured-h200.yaml)", bucket.high


def test_h100_plan_for_a_superseded_cell_reads_its_new_measurement_not_the_stale_one():
    """Triton fp8_block on Qwen3-30B-A3B at one token: its H100 records (sessions 5-9, 27.5-41.8 us) predate the
    one-token decode tiles (`superseded`), and session 43 timed the cell again (23.4 us). The plan reads session 43's
    time, not a stale record. Until then the H100 had no current time of this cell and the plan read the H200's
    measurement of it, scaled to the H100 (the level order that chose that stays checked on its own below)."""
    spec = _script().MACHINES["nvidia-h100"]
    cell = ("triton", "fp8_block", "qwen3-30b-a3b", 1)
    assert cell[:2] in spec.superseded

    def times(names):
        return [r["us"] for name in names for r in json.loads((RESULTS / name).read_text())["records"]
                if (r["experts"], r["quant"], r["preset"], r["tokens"]) == cell]

    stale, (new,) = times(spec.stale_sources), times(["decode_s43_nvidia-h100.json"])
    assert stale and all(us > 1.15 * new for us in stale)  # the stale records would plan otherwise
    problem = load_preset("qwen3-30b-a3b").problem(quant="fp8_block", max_tokens=1)
    (bucket,) = plan(problem, Platform.preset("h100"), Policy(buckets=(1,))).buckets
    (triton,) = [s for s in bucket.ranking if s.pair.experts == "triton"]
    assert triton.experts.basis == "measured at this shape (measured-h100.yaml)"
    assert triton.experts.us == pytest.approx(new)


def test_a_siblings_measurement_of_this_shape_comes_before_this_platforms_other_shapes():
    """The order of `Profile.points`' measured levels: this platform at this shape, the sibling at this shape, this
    platform at other shapes, the sibling at other shapes (each only where it reaches M)."""
    qwen3, mixtral = (load_preset(p).problem(quant="bf16", max_tokens=1) for p in ("qwen3-30b-a3b", "mixtral-8x7b"))
    h100, h200 = Platform.preset("h100"), Platform.preset("h200")

    def entry(platform, problem, preset):
        return ProfileEntry.measurement("triton", platform, problem, 1, 100.0, preset=preset)

    shape = ProfileShape.of(mixtral)
    own_other, sibling_same = entry(h100, qwen3, "qwen3-30b-a3b"), entry(h200, mixtral, "mixtral-8x7b")
    points, basis = Profile((own_other, sibling_same)).points("triton", h100, "bf16", shape, tokens=1)
    assert points == (sibling_same,) and basis.startswith("measured on h200 at this shape")
    points, basis = Profile((own_other,)).points("triton", h100, "bf16", shape, tokens=1)
    assert points == (own_other,) and basis.startswith("measured at other shapes")
    own_same = entry(h100, mixtral, "mixtral-8x7b")
    points, basis = Profile((own_other, sibling_same, own_same)).points("triton", h100, "bf16", shape, tokens=1)
    assert points == (own_same,) and basis.startswith("measured at this shape")


def test_several_shapes_at_one_token_count_count_as_their_mean_whatever_their_order():
    """A level of other shapes can hold two measured at one M: the efficiency there is their mean (it was whichever
    sorted first, so a file's order decided a plan)."""
    h100 = Platform.preset("h100")
    points = [ProfileEntry.measurement("triton", h100, load_preset(p).problem(quant="bf16", max_tokens=1), 1, us,
                                       preset=p) for p, us in (("qwen3-30b-a3b", 40.0), ("mixtral-8x7b", 300.0))]
    each = [efficiency_at((p,), h100, 1)[0] for p in points]
    assert each[0] != pytest.approx(each[1])
    for ordered in (tuple(points), tuple(reversed(points))):
        assert efficiency_at(ordered, h100, 1)[0] == pytest.approx(sum(each) / 2)
