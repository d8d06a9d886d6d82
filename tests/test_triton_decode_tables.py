"""A shape's own choices for the decode path, in its tuned table's ``decode`` section (config.py's docstring):
how the section is read, written and checked, which config `decode.fp8_decode_config` gives at each M, that every
shipped section (fp8 and weight-only) builds valid tiles, and (Triton's CPU interpreter) that a "grouped" entry runs the grouped GEMMs and
a tiles entry the decode path with those tiles."""

import dataclasses
import json
import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from moe.errors import MoEConfigError  # noqa: E402
from moe.experts._triton import config as cfg  # noqa: E402
from moe.experts._triton import decode  # noqa: E402
from moe.experts._triton.decode import (FP8_DECODE_CONFIGS, DecodeConfig, DecodeTile, decode_config,  # noqa: E402
                                        fp8_decode_config)
from moe.experts._triton.support import config_key  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from tests.test_triton import make_problem, make_topk, make_weights  # noqa: E402
from tests.test_triton_weight_only import run  # noqa: E402

TILE = {"block_n": 64, "block_k": 128, "splits": 2, "block_m": 16, "dot": True, "asm": False, "num_warps": 4,
        "num_stages": 3, "finish": True}
SECTION = {"1": {"gemm1": TILE, "gemm2": dict(TILE, block_n=32)}, "2": "grouped", "8": "default"}


def table(section=SECTION, key=None) -> cfg.ConfigTable:
    key = key or config_key(make_problem("fp8_block"), "standard", torch.device("cpu"))
    return cfg.ConfigTable.from_json(key, {"configs": {}, "decode": section})


def test_a_decode_section_survives_a_save_and_a_load(tmp_path):
    written = table()
    path = written.save(tmp_path)
    assert json.loads(path.read_text())["decode"] == SECTION
    assert cfg.ConfigTable.load(written.key, tmp_path) == written
    assert [m for m, _ in written.decode] == [1, 2, 8]


def test_a_table_without_a_decode_section_writes_none(tmp_path):
    key = config_key(make_problem("fp8_block"), "standard", torch.device("cpu"))
    assert cfg.ConfigTable(key).decode == ()
    assert "decode" not in json.loads(cfg.ConfigTable(key).save(tmp_path).read_text())


def test_a_table_with_a_decode_section_stays_a_hashable_value():
    assert hash(table()) == hash(table()) and table() == table()


@pytest.mark.parametrize("entry", ["fast", {"gemm1": TILE}, {"gemm1": TILE, "gemm2": 3}, ["grouped"]])
def test_a_bad_decode_entry_is_refused_naming_it(entry):
    with pytest.raises(MoEConfigError, match="decode entry '4'"):
        table({"4": entry})


def test_a_tiles_entry_with_a_field_decode_tile_lacks_is_refused_when_built():
    config = table({"1": {"gemm1": dict(TILE, warps=4), "gemm2": TILE}})
    with pytest.raises(MoEConfigError, match="decode entry .*warps"):
        fp8_decode_config(1, config)


def test_a_table_with_a_bad_tiles_entry_is_refused_when_the_weights_are_prepared(monkeypatch):
    p = make_problem("fp8_block", "silu", E=8, k=2, H=256, I=128, max_tokens=8)
    bad = table({"2": {"gemm1": dict(TILE, warps=4), "gemm2": TILE}}, config_key(p, "standard", torch.device("cpu")))
    monkeypatch.setattr("moe.experts.triton.ConfigTable.load", lambda key: bad)
    with pytest.raises(MoEConfigError, match="decode entry .*warps"):
        TritonExperts(p).prepare_weights(make_weights(p))


def test_the_entry_at_or_below_m_decides_else_the_shared_config():
    t = table()
    want_tiles = DecodeConfig(DecodeTile(**TILE), DecodeTile(**dict(TILE, block_n=32)))
    assert fp8_decode_config(1, t) == want_tiles
    assert fp8_decode_config(2, t) is None and fp8_decode_config(7, t) is None  # "grouped" from 2 up to 7
    assert fp8_decode_config(8, t) == fp8_decode_config(32, t) == FP8_DECODE_CONFIGS[2]  # "default" from 8
    assert fp8_decode_config(1) == FP8_DECODE_CONFIGS[1] and fp8_decode_config(4) == FP8_DECODE_CONFIGS[2]
    no_one = table({"4": "grouped"})
    assert fp8_decode_config(1, no_one) == FP8_DECODE_CONFIGS[1]  # below the first entry: the shared config


def test_every_shipped_decode_section_builds_its_tiles():
    sections = 0
    for path in sorted(cfg.CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        if "decode" not in data:
            continue
        sections += 1
        loaded = cfg.ConfigTable.from_json(cfg.ConfigKey(**data["key"]), data)
        scheme = data["key"]["scheme"]
        assert scheme in ("fp8_block", "fp8_token", "mxfp4", "nvfp4", "mxfp8"), path.name  # a decode path's scheme
        for m, _ in loaded.decode:
            if scheme.startswith("fp8"):
                config = fp8_decode_config(m, loaded)
            else:  # weight-only: by rows per expert past the table's entries
                config = decode_config(m * loaded.key.top_k / loaded.key.num_experts, m, loaded)
            assert config is None or isinstance(config, DecodeConfig), (path.name, m)
    # fp8: Qwen3-30B-A3B's, GPT-OSS-120B's and the DeepSeek-V3 EP8 slice's on the H200; weight-only: Qwen3's and
    # GPT-OSS's, MXFP4 and NVFP4
    assert sections >= 7


@pytest.fixture
def fp8_case(monkeypatch):
    """(problem, experts, prepared weights, the configs each decode launch ran with: recorded as they run)."""
    p = make_problem("fp8_block", "silu", E=8, k=2, H=256, I=128, max_tokens=8)
    experts = TritonExperts(p)
    prepared = experts.prepare_weights(make_weights(p))
    ran = []
    real = decode.decode_experts
    monkeypatch.setattr("moe.experts.triton.decode_experts", lambda *a: ran.append(a[6]) or real(*a))
    return p, experts, prepared, ran


def test_a_grouped_entry_runs_the_grouped_gemms(fp8_case, monkeypatch):
    p, experts, prepared, ran = fp8_case
    x, topk = torch.randn(2, p.hidden_size).half(), make_topk(2, p)
    grouped_table = dataclasses.replace(prepared, configs=table({"2": "grouped"}, prepared.configs.key))
    out = run(experts, grouped_table, x, topk).out.float().clone()
    assert ran == []  # no decode launch
    monkeypatch.setattr("moe.experts.triton.uses_decode", lambda *a: False)
    assert torch.equal(out, run(experts, prepared, x, topk).out.float())  # the grouped path's own output


def test_a_tiles_entry_runs_the_decode_path_with_its_tiles(fp8_case):
    p, experts, prepared, ran = fp8_case
    x, topk = torch.randn(1, p.hidden_size).half(), make_topk(1, p)
    own = {"gemm1": dict(TILE, block_n=32), "gemm2": dict(TILE, block_n=64)}
    run(experts, dataclasses.replace(prepared, configs=table({"1": own}, prepared.configs.key)), x, topk)
    assert ran == [DecodeConfig(DecodeTile(**own["gemm1"]), DecodeTile(**own["gemm2"]))]


def test_a_tma_decode_entry_makes_its_descriptors_at_load(monkeypatch):
    """A table's ``tma=True`` decode tiles get their weight descriptors when the experts prepare the weights (their
    checks then, not at the first forward; an entry's left-out fields take DecodeTile's defaults); fp4 weights, which
    TMA tiles cannot load, are refused there naming the scheme."""
    tma = dict(TILE, tma=True)
    gemm2 = {k: v for k, v in dict(tma, block_n=32).items() if k != "block_k"}  # DecodeTile's default block_k, 128
    section = {"1": {"gemm1": tma, "gemm2": gemm2}}
    for quant in ("fp8_block", "mxfp4"):
        p = make_problem(quant)
        monkeypatch.setattr(cfg.ConfigTable, "load", lambda key, *a, **kw: table(section, key))
        if quant == "mxfp4":
            with pytest.raises(MoEConfigError, match="tma=True needs contiguous dense or fp8 weights.*mxfp4"):
                TritonExperts(p).prepare_weights(make_weights(p))
            continue
        prepared = TritonExperts(p).prepare_weights(make_weights(p))
        assert (64, 128) in prepared.w13.descriptors and (32, 128) in prepared.w2.descriptors
        assert (32, 128) not in prepared.w13.descriptors
