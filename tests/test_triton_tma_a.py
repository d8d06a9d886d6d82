"""tma_a=True tiles (gemm_tma_a.py): A rows gathered into sorted order, both operands by TMA descriptor.

Under TRITON_INTERPRET=1 the descriptors load as on the GPU (zero fill past the tensor): these tests
check the numbers and the row bookkeeping; tests/test_triton_compiles_for_gpu.py compiles the kernels
for sm90.
"""

import pytest
import torch

from moe.errors import MoEConfigError
from moe.experts._triton import config as cfg
from moe.experts._triton.align import align_block_size_reference, padded_rows
from moe.experts._triton.gemm import BatchedRows, grouped_gemm
from moe.experts._triton.gemm_tma_a import gather_sorted_rows, workspace_rows
from moe.experts._triton.support import config_key
from moe.experts._triton.weights import prepare_triton_weights
from moe.experts.triton import TritonExperts
from moe.formats import ActivationFormat, DispatchShape
from tests.test_triton import make_problem, make_topk, make_weights, reference_reduced
from tests.test_triton_weight_only import run

EP_MAP = (-1, 0, -1, -1, 1, -1, 2, -1)  # experts 1, 4, 6 of 8 live here


def tma_a_config(block_m=16, gemm2_tma_a=True, block_n=32, block_k=32) -> cfg.LaunchConfig:
    gemm1 = cfg.TileConfig(block_n, block_k, tma=True, tma_a=True)
    gemm2 = cfg.TileConfig(block_n, block_k, tma=True, tma_a=gemm2_tma_a)
    return cfg.LaunchConfig(block_m, gemm1, gemm2)


def forward(p, weights, x, topk, config, monkeypatch) -> torch.Tensor:
    experts = TritonExperts(p)
    monkeypatch.setattr(cfg.ConfigTable, "lookup", lambda self, m: config)
    return run(experts, experts.prepare_weights(weights), x, topk).out


@pytest.mark.parametrize("tokens", [1, 3, 33])
@pytest.mark.parametrize("quant,activation,bias,expert_map", [
    ("fp16", "silu", False, None),
    ("fp16", "relu2", True, EP_MAP),
    ("fp32", "swiglu_oai", True, EP_MAP),
    ("fp32", "gelu", False, None),
])
@pytest.mark.parametrize("gemm2_tma_a", [True, False])
def test_tma_a_matches_reference_and_pointer_path(tokens, quant, activation, bias, expert_map, gemm2_tma_a,
                                                  monkeypatch):
    """Ragged M (1 token: most experts get no row, the hit ones one), gated and not, biases, an expert map;
    GEMM2 by descriptor from the sorted intermediate, or by the pointer kernel from the scattered one.
    The TMA-A path equals the reference and the pointer path (same tiles, tma_a off)."""
    torch.manual_seed(tokens)
    p = make_problem(quant, activation, E=8, k=3, bias=bias, expert_map=expert_map)
    weights = make_weights(p)
    x = torch.randn(tokens, p.hidden_size).to(p.dtype)
    topk = make_topk(tokens, p)
    config = tma_a_config(gemm2_tma_a=gemm2_tma_a)
    out = forward(p, weights, x, topk, config, monkeypatch).float()
    plain = cfg.LaunchConfig(16, cfg.TileConfig(32, 32, tma=True), cfg.TileConfig(32, 32, tma=True))
    pointer = forward(p, weights, x, topk, plain, monkeypatch).float()
    ref = reference_reduced(p, x, topk, weights).float()
    tol = 1e-5 if quant == "fp32" else 5e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out, pointer, atol=tol, rtol=tol)


def test_tma_a_tails_and_large_blocks(monkeypatch):
    """K and N not multiples of the tiles (H = 80, I = 48: TMA's zero fill and the stored-column mask),
    BLOCK_M 64 with few rows (padding rows computed, never stored)."""
    torch.manual_seed(0)
    p = make_problem("fp32", "silu", E=4, k=2, H=80, I=48, bias=True)
    weights = make_weights(p)
    x = torch.randn(7, p.hidden_size)
    topk = make_topk(7, p)
    out = forward(p, weights, x, topk, tma_a_config(block_m=64, block_n=64, block_k=32), monkeypatch)
    torch.testing.assert_close(out, reference_reduced(p, x, topk, weights), atol=1e-5, rtol=1e-5)


def test_gather_sorted_rows_copies_slot_rows_and_leaves_padding_rows():
    torch.manual_seed(0)
    num_tokens, k, experts, block_m = 5, 2, 4, 4
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(num_tokens)]).int()
    layout = align_block_size_reference(ids, None, experts, block_m)
    src = torch.randn(num_tokens, 24).half()
    dst = torch.full((layout.sorted_slots.numel() + 3, 24), float("nan")).half()
    got = gather_sorted_rows(src, layout, k, dst)
    assert got.shape[0] == layout.sorted_slots.numel()
    start = 0
    for e in range(experts):
        count, end = int(layout.expert_counts[e]), int(layout.expert_ends[e])
        slots = layout.sorted_slots[start:start + count].long()
        torch.testing.assert_close(got[start:start + count], src[slots // k], atol=0, rtol=0)
        assert torch.isnan(got[start + count:end]).all()  # padding rows: not written
        start = end
    assert any(int(c) % block_m for c in layout.expert_counts)  # the layout has padding rows to check
    assert torch.isnan(dst[start:]).all()  # past the last segment: not written


def test_workspace_has_room_for_padding_rows_when_dense():
    dense = make_problem("fp16", E=8, k=3, max_tokens=33)
    shapes = dict(TritonExperts(dense).workspace_shapes(DispatchShape(ActivationFormat.STANDARD, 33)))
    rows = padded_rows(33 * 3, 8, cfg.BLOCK_MS)
    assert rows == workspace_rows(33 * 3, 8) > 33 * 3
    assert shapes["inter"].shape[0] == rows and shapes["y"].shape[0] == rows
    quantized = make_problem("fp8", E=8, k=3, max_tokens=33)  # never tma_a: one row per slot, as before
    shapes = dict(TritonExperts(quantized).workspace_shapes(DispatchShape(ActivationFormat.STANDARD, 33)))
    assert shapes["inter"].shape[0] == 33 * 3 and shapes["y"].shape[0] == 33 * 3


def test_tma_a_configs_refused():
    with pytest.raises(MoEConfigError, match="tma_a=True needs tma=True"):
        cfg.TileConfig(32, 32, tma_a=True)
    tma_a, plain = cfg.TileConfig(32, 32, tma=True, tma_a=True), cfg.TileConfig(32, 32, tma=True)
    with pytest.raises(MoEConfigError, match="gemm2.tma_a=True needs gemm1.tma_a=True"):
        cfg.LaunchConfig(16, plain, tma_a)
    with pytest.raises(MoEConfigError, match="need sorted rows"):
        cfg.LaunchConfig(16, tma_a, tma_a, direct=True)


def test_tma_a_table_entries_round_trip_and_old_entries_load():
    """A table's tile may carry ``"tma_a": true``; an entry written before the flag existed loads as
    tma_a=False."""
    config = tma_a_config(gemm2_tma_a=False)
    data = config.to_dict()
    assert data["gemm1"]["tma_a"] is True and data["gemm2"]["tma_a"] is False
    assert cfg.LaunchConfig.from_dict(data) == config
    old = {"block_m": 64, "gemm1": {"block_n": 128, "block_k": 64, "tma": True}, "gemm2": {"block_n": 64, "block_k": 64}}
    loaded = cfg.LaunchConfig.from_dict(old)
    assert loaded.gemm1 == cfg.TileConfig(128, 64, tma=True) and not loaded.gemm1.tma_a and not loaded.gemm2.tma_a


def test_tma_a_refuses_quantized_weights_at_load():
    p = make_problem("fp8")
    table = cfg.ConfigTable(config_key(p, "standard", torch.device("cpu")), ((1, tma_a_config()),))
    with pytest.raises(MoEConfigError, match="tma_a=True tiles need dense weights.*fp8"):
        prepare_triton_weights(make_weights(p), None, table)


def test_pointer_kernel_refuses_tma_a_tile():
    """A tma_a tile reaching the pointer kernel (the batched format) is an error, not a silent fallback."""
    p = make_problem("fp16")
    w = TritonExperts(p).prepare_weights(make_weights(p)).w13
    counts = torch.tensor([1, 0, 2, 0], dtype=torch.int32)
    with pytest.raises(MoEConfigError, match="tma_a=True tile runs only in the standard format's sorted path"):
        grouped_gemm(torch.randn(16, 64).half(), None, w, torch.empty(16, 96).half(), BatchedRows(counts, 4),
                     None, 16, cfg.TileConfig(32, 32, tma=True, tma_a=True))


def test_tma_a_refuses_unaligned_rows(monkeypatch):
    """TMA needs rows of 16-byte multiples: H = 36 in float16 (72 bytes) is refused with the fix."""
    p = make_problem("fp16", H=36, I=32)
    with pytest.raises(MoEConfigError, match="tma_a=True tiles load A rows by TMA.*K = 36"):
        forward(p, make_weights(p), torch.randn(2, 36).half(), make_topk(2, p), tma_a_config(), monkeypatch)
