"""benchmarks/compare_configs.py without a GPU: each ``--config`` (the loaded table, a table file, one config as
JSON) gives the config it names at each M; an M where all give the same config is not timed, the others are
timed in one round of turns; a table file for another problem, a missing file and bad ``--tokens`` are refused
with the flag and value named."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe.errors import MoEConfigError, UnsupportedError
from moe.experts._triton.config import ConfigKey, ConfigTable, LaunchConfig, TileConfig
from tests.helpers import benchmark_script

KEY = ConfigKey(8, 2, 4096, 14336, "silu", "bf16", "standard", "NVIDIA H200")
SMALL = LaunchConfig(64, TileConfig(128, 64, 8, 4, 4, tma=True), TileConfig(128, 64, 8, 4, 4, tma=True))
LARGE = LaunchConfig(128, TileConfig(128, 64, 8, 8, 4, tma=True), TileConfig(256, 64, 8, 8, 3, tma=True))
TABLE = ConfigTable(KEY, ((256, SMALL), (1024, LARGE)))


def write_table(tmp_path, table: ConfigTable, device: str = "NVIDIA H100 80GB HBM3"):
    """``table`` as ``moe tune --out`` writes it, tuned on another GPU."""
    return ConfigTable(dataclasses.replace(table.key, device=device), table.configs).save(tmp_path)


def test_each_config_source_gives_the_config_it_names_at_each_m(tmp_path):
    script = benchmark_script("compare_configs")
    tuned = write_table(tmp_path, ConfigTable(KEY, ((256, LARGE),)))
    table, from_file, fixed = (script.config_source(text, KEY, TABLE)
                               for text in ("table", str(tuned), json.dumps(SMALL.to_dict())))
    assert [table(m) for m in (128, 512, 4096)] == [SMALL, LARGE, LARGE]
    assert [from_file(m) for m in (128, 512, 4096)] == [LARGE, LARGE, LARGE]
    assert {fixed(m) for m in (1, 4096)} == {SMALL}


def test_an_omitted_gemm2_copies_gemm1():
    data = {"block_m": 64, "gemm1": dataclasses.asdict(SMALL.gemm1)}
    config = benchmark_script("compare_configs").config_source(json.dumps(data), KEY, TABLE)(256)
    assert config.gemm2 == config.gemm1 == SMALL.gemm1


def test_only_the_m_where_the_configs_differ_are_timed_in_turns():
    script = benchmark_script("compare_configs")
    asked = []

    def timer(case, configs, rounds):
        asked.append((case, configs, rounds))
        return [100.0, 95.0]

    sources = [TABLE.lookup, lambda m: LARGE]
    rows = script.compare(lambda m: f"case {m}", sources, [384, 2048], rounds=5, timer=timer)
    assert asked == [("case 384", [SMALL, LARGE], 5)]  # at 2048 the table takes LARGE too
    assert [r["us"] for r in rows] == [[100.0, 95.0], None]
    assert rows[0]["configs"] == [SMALL.to_dict(), LARGE.to_dict()]
    assert script.format_row(rows[0], ["table", "#2"]) == "M =    384: table 100.0 us, #2 95.0 us (0.950x)"
    assert "the same config" in script.format_row(rows[1], ["table", "#2"])


def test_a_table_file_for_another_problem_is_refused_naming_the_flag(tmp_path):
    other = write_table(tmp_path, ConfigTable(dataclasses.replace(KEY, scheme="fp8_block"), ((256, SMALL),)))
    with pytest.raises(MoEConfigError, match=r"--config .*fp8_block.*only the device may differ"):
        benchmark_script("compare_configs").config_source(str(other), KEY, TABLE)


def test_a_missing_file_is_refused_naming_the_flag_and_the_choices(tmp_path):
    with pytest.raises(MoEConfigError, match=r"--config .*nothing\.json: not 'table', a LaunchConfig as JSON, or"):
        benchmark_script("compare_configs").config_source(str(tmp_path / "nothing.json"), KEY, TABLE)


@pytest.mark.parametrize("text, what", [('{"block_m": 64}', "a LaunchConfig as JSON"),
                                        ('{"block_m": 64, "gemm1": {"width": 3}}', "a LaunchConfig as JSON"),
                                        ("{not json", "a LaunchConfig as JSON")])
def test_a_config_that_is_not_one_is_refused_naming_the_flag(text, what):
    with pytest.raises(MoEConfigError, match=rf"--config .*: not {what}"):
        benchmark_script("compare_configs").config_source(text, KEY, TABLE)


def test_a_file_that_is_not_a_table_is_refused_naming_the_flag(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"configs": {}}')
    with pytest.raises(MoEConfigError, match=r"--config .*notes\.json: not a table file as moe tune writes it"):
        benchmark_script("compare_configs").config_source(str(path), KEY, TABLE)


@pytest.mark.parametrize("tokens, match", [("256,x", "expected comma-separated integers"),
                                           ("0,256", "every M must be >= 1")])
def test_bad_tokens_are_refused_naming_the_flag_before_any_gpu_work(tokens, match):
    with pytest.raises(MoEConfigError, match=rf"--tokens {tokens}: {match}"):
        benchmark_script("compare_configs").main(["--preset", "mixtral-8x7b", "--tokens", tokens,
                                                  "--config", "table"])


def test_zero_rounds_are_refused_naming_the_flag():
    with pytest.raises(MoEConfigError, match=r"--rounds 0: must be >= 1"):
        benchmark_script("compare_configs").main(["--preset", "mixtral-8x7b", "--tokens", "256", "--rounds", "0",
                                                  "--config", "table"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU would run the comparison")
def test_without_a_gpu_it_says_so():
    with pytest.raises(UnsupportedError, match="needs a CUDA GPU"):
        benchmark_script("compare_configs").main(["--preset", "mixtral-8x7b", "--tokens", "256", "--config", "table"])


def test_the_plot_draws_each_config_against_the_first_where_they_differ(tmp_path):
    pytest.importorskip("matplotlib")
    script = benchmark_script("compare_configs")
    rows = [{"tokens": 256, "us": [100.0, 90.0, 110.0]}, {"tokens": 1024, "us": None},
            {"tokens": 4096, "us": [200.0, 210.0, 190.0]}]
    series = script.ratio_series(rows, ["table", "#2", "#3"])
    assert series == {"#2": [(256, 0.9), (4096, 1.05)], "#3": [(256, 1.1), (4096, 0.95)]}
    script.plot_ratios(tmp_path / "ab.png", series, "test")
    assert (tmp_path / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
