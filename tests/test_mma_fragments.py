"""`weights.mma_fragments`: the MMA decode tiles' weight order, checked by running what each lane does.

The GPU kernel (`_decode_mma`) cannot run in the interpreter (its loads and MMAs are PTX), so this test
plays every lane of a warp in torch: it reads the lane's 16 bytes and scale word as `MMA_STEP_PTX` does,
builds the four ``m16n8k16`` MMAs' A and B fragments from the registers as PTX defines them (lane 4g + t:
A rows g and g + 8 at K columns 2t, 2t + 1, 2t + 8, 2t + 9; B column g at the same K), and checks that the
sum of the MMAs over the K blocks is the dequantized weights times the activations.
"""

import pytest
import torch

from moe.experts._triton.weights import MMA_K, MMA_ROWS, mma_fragments
from moe.errors import MoEConfigError
from moe.quant import QuantFormat, decode_e2m1, dequantize, quantize, unpack_e2m1


def _bytes(words: torch.Tensor) -> torch.Tensor:
    return words.contiguous().view(torch.uint8).view(*words.shape[:-1], 16)


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
            data = _bytes(frags.words[expert, block, kb, lane])
            scale_bytes = frags.scales[expert, block, kb, lane].reshape(1).view(torch.uint8)
            for word in range(4):
                h = word // 2  # the word's group
                codes = data[4 * word: 4 * word + 4]
                for nibble in range(2):  # low nibbles -> the group's first MMA, high -> its second
                    mma = 2 * h + nibble
                    values = decode_e2m1((codes >> (4 * nibble)) & 15)
                    # register r of the A fragment: bytes 0-1 (row g), 2-3 (row g + 8); word 2h + 1 holds R2, R3
                    for byte in range(4):
                        r = byte // 2
                        scale = _scale_values(scale_bytes[2 * h + r], fmt)
                        column = 2 * t + byte % 2 + 8 * (word % 2)
                        a[mma, g + 8 * r, column] = values[byte] * scale
            for mma in range(4):  # B: lane 4g + t holds token g at virtual K 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1)
                h, nibble = divmod(mma, 2)
                first = kb * MMA_K + 32 * h + 8 * t + 4 * nibble  # the lane's 16-byte activation load
                b[mma, [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9], g] = xs[g, first: first + 4]
        out += sum(a[i] @ b[i] for i in range(4))
    return out[:, :tokens]


@pytest.mark.parametrize("fmt", [QuantFormat.MXFP4, QuantFormat.NVFP4])
@pytest.mark.parametrize("rows, k", [(32, 128), (24, 96)])  # the second pads rows to 32 and K to 128
def test_each_lanes_mmas_sum_to_the_weights_times_the_activations(fmt, rows, k):
    torch.manual_seed(0)
    w = torch.randn(2, rows, k) * torch.logspace(-2, 1, k)  # scales differ per group
    q = quantize(w, fmt, "weight")
    frags = mma_fragments(unpack_e2m1(q.data), q.scale, fmt)
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


def test_a_shuffled_byte_is_caught():
    """The check above is not vacuous: swapping two bytes of one lane changes the product."""
    torch.manual_seed(1)
    q = quantize(torch.randn(1, 16, 64), QuantFormat.MXFP4, "weight")
    frags = mma_fragments(unpack_e2m1(q.data), q.scale, QuantFormat.MXFP4)
    x = torch.randn(3, 64)
    good = _warp_product(frags, QuantFormat.MXFP4, x, 0, 0)
    data = _bytes(frags.words[0, 0, 0, 5]).clone()
    data[[0, 2]] = data[[2, 0]]  # row g's byte for row g + 8's
    frags.words[0, 0, 0, 5] = data.view(torch.int32)
    assert not torch.allclose(_warp_product(frags, QuantFormat.MXFP4, x, 0, 0), good)


def test_mma_tile_shape_is_checked():
    from moe.experts._triton.decode import DecodeTile

    DecodeTile(32, 64, 4, 8, False, True, 2, 1, mma=True)
    with pytest.raises(MoEConfigError, match="block_n=16 \\* num_warps"):
        DecodeTile(64, 64, 4, 8, False, True, 2, 1, mma=True)
    with pytest.raises(MoEConfigError, match="block_k=64, 128 or 256"):
        DecodeTile(32, 96, 4, 8, False, True, 2, 1, mma=True)
