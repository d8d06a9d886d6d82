"""Platform: presets, library variants, named predicates, detection on this machine."""

from __future__ import annotations

import pytest
import torch

import moe.platform as platform_module
from moe import MoEConfigError, Platform, UnsupportedError
from moe.platform import PRESET_NAMES, LibrarySupport, median_ms, preset_for_device
from moe.registry import register_library


def test_presets_cover_the_issue_list():
    assert set(PRESET_NAMES) == {"cpu", "a100", "h100", "h200", "b200", "gb200", "rtx-pro-6000"}
    expected_cc = {"a100": (8, 0), "h100": (9, 0), "h200": (9, 0), "b200": (10, 0), "gb200": (10, 0),
                   "rtx-pro-6000": (12, 0)}
    for name, cc in expected_cc.items():
        p = Platform.preset(name)
        assert (p.device, p.capability, p.kind) == ("cuda", cc, name)
        assert p.memory_bandwidth > 0 and p.peak_flops("bf16") > 0 and p.sm_count and p.memory_bytes
        assert {"triton", "flashinfer", "cutlass"} <= p.libraries
        assert p.version_of("flashinfer").startswith("0.7.2")
    cpu = Platform.preset("cpu")
    assert cpu.device == "cpu" and cpu.capability is None and not cpu.libraries


def test_measured_rates_of_the_lent_machines():
    h100, h200 = Platform.preset("h100"), Platform.preset("h200")
    assert h200.memory_bandwidth == pytest.approx(4.2e12) and h100.memory_bandwidth == pytest.approx(3.0e12)
    assert h200.peak_flops("bf16") == h100.peak_flops("bf16") == pytest.approx(768e12)
    assert Platform.preset("b200").peak_flops("fp4") == pytest.approx(9000e12)
    assert h100.peak_flops("fp4") == h100.peak_flops("fp8")  # no fp4 tensor cores on SM90: the next wider


def test_with_libraries_adds_and_removes_features_and_versions():
    b200 = Platform.preset("b200")
    assert b200.has_feature("flashinfer.trtllm_fp4_block_scale_moe")
    assert "cutlass_fused_moe" in b200.features_of("flashinfer")
    bare = b200.with_libraries(remove=("flashinfer",))
    assert not bare.has_library("flashinfer") and not bare.features_of("flashinfer")
    assert bare.version_of("flashinfer") is None and bare.has_library("triton")
    assert bare.with_libraries(add=("flashinfer",)) == b200


def test_platform_is_a_plain_frozen_dataclass_whose_repr_round_trips():
    for name in PRESET_NAMES:
        p = Platform.preset(name)
        assert eval(repr(p)) == p  # noqa: S307 -- our own repr
        with pytest.raises(AttributeError):
            p.name = "x"
    simulated = Platform(name="my-gpu", device="cuda", capability=(9, 0), memory_bandwidth=1e12,
                         peak=(("bf16", 1e15),))
    assert simulated.kind == "my-gpu" and simulated.capability_at_least(8, 9) and not simulated.capability_at_least(10)


def test_errors_name_the_value_and_the_choices():
    with pytest.raises(MoEConfigError, match="unknown preset 'h300'.*b200"):
        Platform.preset("h300")
    with pytest.raises(MoEConfigError, match="device must be 'cpu' or 'cuda'"):
        Platform(name="x", device="tpu")
    with pytest.raises(MoEConfigError, match="no peak rate for fp8"):
        Platform(name="x", device="cuda").peak_flops("fp8")


@pytest.mark.parametrize("name,cc,preset", [
    ("NVIDIA H100 80GB HBM3", (9, 0), "h100"),
    ("NVIDIA H200", (9, 0), "h200"),
    ("NVIDIA B200", (10, 0), "b200"),
    ("NVIDIA GB200", (10, 0), "gb200"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "a100"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), "rtx-pro-6000"),
    ("NVIDIA H20", (9, 0), "h100"),
    ("NVIDIA L40S", (8, 9), "a100"),
])
def test_a_real_device_takes_the_rates_of_the_preset_it_resembles(name, cc, preset):
    found, how = preset_for_device(name, cc)
    assert found == preset
    assert ("device name" in how) == (preset.replace("-", " ") in name.lower() or preset in name.lower())


def test_detect_reads_this_machine():
    p = Platform.detect("cpu")
    assert p.device == "cpu" and p.kind == "cpu" and Platform.detect("cpu") is p  # probed once
    import importlib.util

    for lib in ("triton", "flashinfer"):
        assert p.has_library(lib) == (importlib.util.find_spec(lib) is not None)
    if p.has_library("flashinfer"):
        assert p.has_feature("flashinfer.cutlass_fused_moe") and p.version_of("flashinfer")
    if torch.cuda.is_available():
        gpu = Platform.detect()
        assert gpu.is_cuda and gpu.capability == torch.cuda.get_device_capability() and gpu.kind in PRESET_NAMES


def test_measure_rates_needs_a_cuda_gpu():
    with pytest.raises(UnsupportedError, match="measure_rates: measures a CUDA GPU, and cpu is none"):
        Platform.preset("h200").measure_rates("cpu")


def test_measure_rates_keeps_the_presets_ratios_where_it_measures_nothing(monkeypatch):
    """The bench's ceilings: bandwidth and bf16 measured; fp8 measured where it can be, else bf16 times
    the preset's ratio; the other precisions keep their ratio to bf16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(platform_module, "_measure_bandwidth", lambda device: 4.0e12)
    rates = {torch.bfloat16: 700e12, torch.float8_e4m3fn: None}
    monkeypatch.setattr(platform_module, "_measure_matmul_flops", lambda device, dtype: rates[dtype])
    h200 = Platform.preset("h200")
    measured = h200.measure_rates("cuda")
    assert measured.memory_bandwidth == 4.0e12 and measured.peak_flops("bf16") == 700e12
    assert measured.peak_flops("fp8") == pytest.approx(700e12 * h200.peak_flops("fp8") / h200.peak_flops("bf16"))
    assert measured.peak_flops("fp32") == pytest.approx(700e12 * h200.peak_flops("fp32") / h200.peak_flops("bf16"))
    assert measured.rates_source == "measured on h200 (bandwidth, bf16)"
    rates[torch.float8_e4m3fn] = 1300e12
    assert h200.measure_rates("cuda").peak_flops("fp8") == 1300e12


def test_median_ms_calls_warmup_then_reps_and_takes_the_median(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the wall clock
    clock = iter([0.0, 0.001, 1.0, 1.005, 2.0, 2.002])  # three timed calls: 1 ms, 5 ms, 2 ms
    monkeypatch.setattr(platform_module.time, "perf_counter", lambda: next(clock))
    calls = []
    assert median_ms(lambda: calls.append(1), reps=3, warmup=2) == pytest.approx(2.0)
    assert len(calls) == 5


def test_backends_declare_their_libraries_and_the_platform_reads_them(monkeypatch):
    """FlashInfer's probe and what a preset assumes of it come from its backend's declaration
    (moe.registry.register_library), not from the platform module."""
    from moe.experts._flashinfer.library import FEATURE_SOURCES, FEATURES, SOURCE_FEATURES

    b200 = Platform.preset("b200")
    assert FEATURES == set(FEATURE_SOURCES) | set(SOURCE_FEATURES) and "moe_alltoall" in FEATURES
    assert b200.features_of("flashinfer") == FEATURES
    assert (b200.version_of("flashinfer"), b200.version_of("triton")) == ("0.7.2.post1", "3.6.0")
    monkeypatch.setattr(platform_module, "_DECLARED_LIBRARIES", dict(platform_module._DECLARED_LIBRARIES))
    somelib = LibrarySupport("somelib", probe=lambda: frozenset({"probed"}), assumed_features=frozenset({"fast"}),
                             assumed_version="1.2")
    register_library(somelib)
    simulated = Platform.preset("cpu").with_libraries(add=("somelib",))
    assert simulated.has_feature("somelib.fast") and simulated.version_of("somelib") == "1.2"
    assert "somelib.probed" in platform_module._probe_features(frozenset({"somelib"}))
    assert "somelib.probed" not in platform_module._probe_features(frozenset())  # probed only where installed
    with pytest.raises(MoEConfigError, match=r"library 'somelib' is already declared .* declare each library once"):
        register_library(LibrarySupport("somelib", assumed_version="2.0"))
