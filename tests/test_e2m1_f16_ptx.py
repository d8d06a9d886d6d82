"""The FMA decode path's e2m1 PTX (`_decode._E2M1_F16X2`), run on the CPU: the interpreter runs no PTX, so
the PTX text itself is executed here by a small emulator of the instructions it uses (shl, shr, and, or on
32-bit registers, mov splitting one into two 16-bit halves, cvt.rn.f16x2.e4m3x2) for every byte in every
position, and each output is checked against the e2m1 table: the value times `E2M1_F16X2_UNIT` as float16,
exact; and `decode.tile_asm`, which chooses it."""

import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from moe.experts._triton._decode import _E2M1_F16X2, E2M1_F16X2_UNIT  # noqa: E402
from moe.experts._triton.decode import DecodeTile, tile_asm  # noqa: E402
from moe.quant import QuantFormat  # noqa: E402

E2M1_VALUES = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
MASK = 0xFFFFFFFF


def _f16_bits(value: torch.Tensor) -> int:
    return value.to(torch.float16).view(torch.int16).item() & 0xFFFF


def _cvt_f16x2_e4m3x2(a: int) -> int:
    """cvt.rn.f16x2.e4m3x2: the 16-bit source's low byte to the low float16 half, its high byte to the high."""
    halves = torch.tensor([a & 255, (a >> 8) & 255], dtype=torch.uint8).view(torch.float8_e4m3fn)
    return _f16_bits(halves[0]) | (_f16_bits(halves[1]) << 16)


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """Executes ``text`` (one brace block; ``$n`` operands) on 32-bit and 16-bit registers; returns every
    register."""
    regs = dict(inputs)

    def value(token: str) -> int:
        token = token.strip()
        return regs[token] if token in regs else int(token, 0) & MASK

    ops = {
        "mov.b32": lambda a: a,
        "shl.b32": lambda a, b: (a << b) & MASK,
        "shr.b32": lambda a, b: a >> b,  # .b32: logical
        "and.b32": lambda a, b: a & b,
        "or.b32": lambda a, b: a | b,
        "cvt.rn.f16x2.e4m3x2": _cvt_f16x2_e4m3x2,
    }
    for line in text.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        opcode, operands = line.split(None, 1)
        split = re.fullmatch(r"\{\s*(\w+)\s*,\s*(\w+)\s*\}\s*,\s*(\w+)", operands.strip())
        if opcode == "mov.b32" and split:  # {low, high} 16-bit halves of a 32-bit register
            low, high, source = split.groups()
            regs[low], regs[high] = regs[source] & 0xFFFF, regs[source] >> 16
            continue
        assert opcode in ops, f"the emulator does not know {opcode}: {line}"
        dest, *args = [o.strip() for o in operands.split(",")]
        regs[dest] = ops[opcode](*(value(a) for a in args))
    return regs


def _f16(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16).item()


def test_the_emulator_reads_cvt_e4m3x2_as_the_ptx_manual_does():
    assert _cvt_f16x2_e4m3x2(0x3830) == 0x3C003800  # e4m3 0x30 = 0.5 to the low half, 0x38 = 1.0 to the high
    assert _cvt_f16x2_e4m3x2(0x8001) == 0x80001800  # -0 high; the smallest subnormal 2**-9 low
    regs = run_ptx("{\n.reg .b16 l, h;\nmov.b32 {l, h}, r0;\n}", {"r0": 0x12345678})
    assert (regs["l"], regs["h"]) == (0x5678, 0x1234)


@pytest.mark.parametrize("position", range(4))
def test_every_byte_in_every_position_decodes_exactly(position):
    """Byte ``position`` of the 32-bit input: its low nibble is element ``position`` of the low output
    (``$0``: elements 0, 1; ``$1``: 2, 3, each in a float16 half), its high nibble the same element of
    the high output (``$2``, ``$3``); the other three bytes hold other codes, which must not leak."""
    text = re.sub(r"\$(\d)", r"r\1", _E2M1_F16X2.value)
    for byte in range(256):
        others = (0x5A, 0xC3, 0x99, 0x0F)
        packed = 0
        for i in range(4):
            packed |= (byte if i == position else others[i]) << (8 * i)
        out = run_ptx(text, {"r4": packed})
        for half_tile, nibble in ((0, byte & 15), (2, byte >> 4)):
            register = out[f"r{half_tile + position // 2}"]
            bits = (register >> (16 * (position % 2))) & 0xFFFF
            got = _f16(bits)
            assert got == E2M1_VALUES[nibble] * E2M1_F16X2_UNIT, (byte, position, half_tile, hex(register))
            assert (bits >> 15) == (nibble >> 3)  # the sign survives, -0 included


def _weights(fmt):
    return SimpleNamespace(w13=SimpleNamespace(fmt=fmt), small_scales=False)


@pytest.mark.parametrize("fmt,dot,dtype,cuda,want,sm", [
    (QuantFormat.MXFP4, False, torch.bfloat16, True, False, (8, 0)),  # an A100: no cvt from e4m3, integer path
    (QuantFormat.MXFP4, False, torch.bfloat16, True, True, (8, 9)),
    (QuantFormat.MXFP4, False, torch.bfloat16, True, True, (9, 0)),  # the FMA path's PTX: exact for any scale
    (QuantFormat.MXFP4, False, torch.float16, True, True, (9, 0)),  # and any activation dtype
    (QuantFormat.NVFP4, False, torch.float32, True, True, (9, 0)),
    (QuantFormat.MXFP4, False, torch.bfloat16, False, False, (9, 0)),  # the interpreter runs no PTX
    (QuantFormat.MXFP4, True, torch.bfloat16, True, False, (9, 0)),  # tensor cores: bf16x2, MXFP4 needs small scales
    (QuantFormat.NVFP4, True, torch.bfloat16, True, True, (9, 0)),
    (QuantFormat.MXFP8, False, torch.bfloat16, True, False, (9, 0)),  # no PTX for e4m3 weights
])
def test_tile_asm_choice(fmt, dot, dtype, cuda, want, sm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: sm)
    tile = DecodeTile(32, 128, 1, 16 if dot else 1, dot)
    assert tile_asm(tile, _weights(fmt), SimpleNamespace(dtype=dtype, is_cuda=cuda, device="cuda")) is want
    assert tile_asm(DecodeTile(32, 128, 1, 16 if dot else 1, dot, asm=False), _weights(fmt),
                    SimpleNamespace(dtype=dtype, is_cuda=cuda, device="cuda")) is False
