"""benchmarks/mxfp4_decode.py's tile lists (no GPU needed): ``--tiles`` items with their optional finish and TMA fields,
a malformed item refused naming it, and ``--tma`` adding a TMA twin of every fp8 tensor-core candidate."""

import pytest

from moe.experts._triton.decode import DecodeTile
from tests.helpers import benchmark_script

sweep = benchmark_script("mxfp4_decode")


def test_tiles_take_optional_finish_and_tma_fields():
    plain, finish, tma = sweep.parse_tiles("128:128:4:16:4:2,128:128:4:16:4:2:1,128:128:4:16:4:2:1:1")
    assert plain == DecodeTile(128, 128, 4, 16, True, True, 4, 2)
    assert finish == DecodeTile(128, 128, 4, 16, True, True, 4, 2, finish=True)
    assert tma == DecodeTile(128, 128, 4, 16, True, True, 4, 2, finish=True, tma=True)
    with pytest.raises(SystemExit, match="'1:2:3' is not n:k:splits:block_m:warps:stages"):
        sweep.parse_tiles("1:2:3")


def test_tma_adds_a_twin_of_every_fp8_tensor_core_candidate():
    plain = sweep.candidates(16, quant="fp8_block")
    both = sweep.candidates(16, quant="fp8_block", tma=True)
    assert len(both) == 2 * len(plain) and not any(t.tma for t in plain)
    assert [t for t in both if not t.tma] == plain
    assert [t for t in both if t.tma] == [DecodeTile(**{**t.__dict__, "tma": True}) for t in plain]
