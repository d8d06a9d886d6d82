"""`weights.mma_fragments`: the MMA decode tiles' weight order, checked by running what each lane does.

The GPU kernel (`_decode_mma`) cannot run in the interpreter (its loads and MMAs are PTX), so this test
plays every lane of a warp in torch: it reads the lane's 4 words and scale word with the PTX's bit operations,
builds the four ``m16n8k16`` MMAs' A and B fragments from the registers as PTX defines them (lane 4g + t:
A rows g and g + 8 at K columns 2t, 2t + 1, 2t + 8, 2t + 9; B column g at the same K), and checks that the
sum of the MMAs over the K blocks is the dequantized weights times the activations.
"""

import pytest
import torch

from moe.errors import MoEConfigError
from moe.experts._triton.weights import (FRAGMENT_BITS, MMA_K, MMA_ROWS, fragment_words, fragments_fit,
                                         mma_fragment_bytes, mma_fragments)
from moe.quant import QuantFormat, decode_e2m1, dequantize, quantize

M = 0x81C081C0  # bf16 bits 6..8 and 15 of both halves


def _registers(word: int) -> list[int]:
    """`_decode_mma.e2m1_fragment_ptx`'s bit operations on one word: its 4 bf16x2 registers before the scale."""
    word &= 0xFFFFFFFF
    r3 = ((word >> 4) & 0x00400040) | ((word >> 6) & 0x01800180) | ((word << 4) & 0x80008000)
    return [word & M, (word << 3) & M, (word << 6) & M, r3 & 0xFFFFFFFF]


def _bf16(bits: int) -> float:
    """A bf16 bit pattern's value times 2**126 (the PTX's bias, undone by the biased scale)."""
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item() * 2.0**126


def _scale_values(byte: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    if fmt is QuantFormat.MXFP4:
        return torch.exp2(byte.float() - 127)
    return byte.view(torch.float8_e4m3fn).float()


def _warp_product(frags, fmt: QuantFormat, x: torch.Tensor, expert: int, block: int) -> torch.Tensor:
    """``[16, tokens]``: rows 16 * block .. + 15 of ``expert`` times ``x [tokens <= 8, K]``, as a warp computes it."""
    tokens = x.shape[0]
    k_blocks = frags.k_blocks
    xs = torch.zeros(8, k_blocks * MMA_K)
    xs[:tokens, : x.shape[1]] = x
    out = torch.zeros(16, 8)
    for kb in range(k_blocks):
        a = torch.zeros(4, 16, 16)  # the step's 4 MMAs: A [rows, virtual K]
        b = torch.zeros(4, 16, 8)  # B [virtual K, tokens]
        for lane in range(32):
            g, t = divmod(lane, 4)
            scale_bytes = frags.scales[expert, block, kb, lane].reshape(1).view(torch.uint8)
            for index in range(4):  # word 2h + w: group h; w = 0 -> A registers R0, R1; w = 1 -> R2, R3
                h, w = divmod(index, 2)
                for j, bits in enumerate(_registers(int(frags.words[expert, block, kb, lane, index]))):
                    mma, r = 2 * h + j // 2, j % 2  # j: (first MMA, second MMA) x (row g, row g + 8)
                    scale = _scale_values(scale_bytes[2 * h + r], fmt)
                    for half in range(2):
                        value = _bf16((bits >> (16 * half)) & 0xFFFF) * scale
                        a[mma, g + 8 * r, 2 * t + 8 * w + half] = value  # fragment register 2w + r
            for mma in range(4):  # B: lane 4g + t holds token g at virtual K 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1)
                h, second = divmod(mma, 2)
                first = kb * MMA_K + 32 * h + 8 * t + 4 * second  # the lane's 16-byte activation load
                b[mma, [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9], g] = xs[g, first: first + 4]
        out += sum(a[i] @ b[i] for i in range(4))
    return out[:, :tokens]


def test_fragment_words_use_every_bit_once():
    bits = [p + 16 * h for places in FRAGMENT_BITS for p in places for h in range(2)]
    assert sorted(bits) == list(range(32))
    codes = torch.arange(16, dtype=torch.uint8)
    for j in range(4):  # each code alone in each place reads back as its e2m1 value
        for half in range(2):
            for code in codes:
                c = torch.zeros(4, 2, dtype=torch.uint8)
                c[j, half] = code
                word = int(fragment_words(c))
                got = [_bf16((r >> (16 * hh)) & 0xFFFF) for r in _registers(word) for hh in range(2)]
                want = [0.0] * 8
                want[2 * j + half] = float(decode_e2m1(code.reshape(1)))
                assert got == want, (j, half, int(code))


@pytest.mark.parametrize("fmt", [QuantFormat.MXFP4, QuantFormat.NVFP4])
@pytest.mark.parametrize("rows, k", [(32, 128), (24, 96)])  # the second pads rows to 32 and K to 128
def test_each_lanes_mmas_sum_to_the_weights_times_the_activations(fmt, rows, k):
    torch.manual_seed(0)
    w = torch.randn(2, rows, k) * torch.logspace(-2, 1, k)  # scales differ per group
    q = quantize(w, fmt, "weight")
    frags = mma_fragments(q.data, q.scale, fmt)
    assert frags.words.shape == (2, -(-rows // MMA_ROWS), -(-k // MMA_K), 32, 4)
    assert frags.scales.shape == frags.words.shape[:-1]
    dense = dequantize(q)
    if fmt is QuantFormat.NVFP4:  # the global scale is applied after the K sum, outside the fragments
        dense = dense / q.global_scale[:, None, None]
    x = torch.randn(5, k)
    for expert in range(2):
        for block in range(frags.row_blocks):
            got = _warp_product(frags, fmt, x, expert, block)
            rows_here = dense[expert, 16 * block: 16 * block + 16]
            want = rows_here @ x.T
            # float32 sums in another order
            torch.testing.assert_close(got[: len(rows_here)], want, rtol=1e-4, atol=1e-4)
            assert not got[len(rows_here):].any()  # padded rows hold code 0


def test_a_swapped_word_is_caught():
    """The check above is not vacuous: swapping two words of one lane changes the product."""
    torch.manual_seed(1)
    q = quantize(torch.randn(1, 16, 64), QuantFormat.MXFP4, "weight")
    frags = mma_fragments(q.data, q.scale, QuantFormat.MXFP4)
    x = torch.randn(3, 64)
    good = _warp_product(frags, QuantFormat.MXFP4, x, 0, 0)
    word = frags.words[0, 0, 0, 5, 0].clone()
    frags.words[0, 0, 0, 5, 0] = frags.words[0, 0, 0, 5, 1]  # one word for another
    frags.words[0, 0, 0, 5, 1] = word
    assert not torch.allclose(_warp_product(frags, QuantFormat.MXFP4, x, 0, 0), good)


def test_mma_tile_shape_is_checked():
    from moe.experts._triton.decode import DecodeTile

    DecodeTile(32, 64, 4, 8, False, True, 2, 1, mma=True)
    with pytest.raises(MoEConfigError, match="block_n=16 \\* num_warps"):
        DecodeTile(64, 64, 4, 8, False, True, 2, 1, mma=True)
    with pytest.raises(MoEConfigError, match="block_k=64, 128 or 256"):
        DecodeTile(32, 96, 4, 8, False, True, 2, 1, mma=True)


def test_fragment_bytes_are_what_mma_fragments_makes():
    q = quantize(torch.randn(3, 40, 160), QuantFormat.NVFP4, "weight")  # pads rows to 48, K to 192
    frags = mma_fragments(q.data, q.scale, QuantFormat.NVFP4)
    assert mma_fragment_bytes(tuple(q.data.shape)) == frags.words.nbytes + frags.scales.nbytes == 3 * 3 * 3 * 32 * 20


def test_fragments_are_skipped_with_one_warning_where_the_gpu_lacks_room(monkeypatch):
    """`TritonExperts` makes the MMA copy only where it leaves FRAGMENT_FREE_FRACTION of the GPU free (no GPU here:
    `torch.cuda.mem_get_info` mocked); short of room it says so once, with the numbers and the way out."""
    from moe.errors import SlowPathWarning
    from moe.experts import triton as triton_experts
    from moe.weights import ExpertWeights

    gib = 2**30
    weights = ExpertWeights.from_dense(torch.randn(4, 64, 128), torch.randn(4, 128, 32), quant="mxfp4",
                                       dtype=torch.bfloat16)
    needed = mma_fragment_bytes(tuple(weights.w13.data.shape)) + mma_fragment_bytes(tuple(weights.w2.data.shape))
    monkeypatch.setattr(triton_experts, "_FRAGMENTS_SKIPPED", [])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)  # nothing cached: a GPU machine's
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)  # own cache would count as room
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 100 * gib))
    assert fragments_fit(torch.device("cuda"), needed)[0]
    assert triton_experts.fragments_room(weights)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 100 * gib))  # 10% free: short
    assert not fragments_fit(torch.device("cuda"), needed)[0]
    with pytest.warns(SlowPathWarning, match="decode_fragments = False") as caught:
        assert not triton_experts.fragments_room(weights)
        assert not triton_experts.fragments_room(weights)
    assert len(caught) == 1 and "GiB free of 100.00" in str(caught[0].message)


def test_room_counts_what_torchs_cache_holds_unused(monkeypatch):
    """A process that freed large tensors keeps their blocks in torch's caching allocator, which the driver reports
    as used; `fragments_fit` counts them as room (reserved minus allocated), and only them: memory in use, or held
    by another process, is not room (all mocked, no GPU here)."""
    gib = 2**30
    needed = 2 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * gib, 100 * gib))  # 5% free for the driver
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 40 * gib)  # 20 GiB cached, unused
    fits, numbers = fragments_fit(torch.device("cuda"), needed)
    assert fits and numbers.endswith("25.00 GiB free of 100.00")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 58 * gib)  # only 2 GiB unused
    fits, numbers = fragments_fit(torch.device("cuda"), needed)
    assert not fits and numbers.endswith("7.00 GiB free of 100.00")
