"""wgmma=True tiles (gemm_wgmma.py): fp8_block GEMMs by a Gluon kernel whose K steps overlap one step's wgmma
with the previous step's scaling. Gluon does not run under the CPU interpreter: here the configs' rules, the
gather of fp8 rows and their scales (a Triton kernel, interpreted), the workspace, the errors, and the kernel
compiled for sm90 with the installed Triton (registers, spills, and no wgmma serialized by ptxas). The numbers
are checked on the GPU: tests/gpu/test_triton_wgmma_gpu.py.
"""

import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from moe.errors import MoEConfigError  # noqa: E402
from moe.experts._triton import config as cfg  # noqa: E402
from moe.experts._triton.align import align_block_size_reference  # noqa: E402
from moe.experts._triton.gemm_tma_a import gather_launch, workspace_rows  # noqa: E402
from moe.experts._triton.support import config_key  # noqa: E402
from moe.experts._triton.weights import prepare_triton_weights  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.formats import ActivationFormat, DispatchShape  # noqa: E402
from tests.test_triton import make_problem, make_topk, make_weights  # noqa: E402
from tests.test_triton_weight_only import run  # noqa: E402


def wgmma_tile(block_n=64, **changes) -> cfg.TileConfig:
    return cfg.TileConfig(block_n, 128, 8, 4, 4, tma=True, wgmma=True, **changes)


@pytest.mark.parametrize("changes", [dict(block_k=64), dict(num_stages=2), dict(tma_a=True), dict(num_warps=2)],
                         ids=["block_k", "stages", "tma_a", "warps"])
def test_wgmma_tile_rules(changes):
    fields = dict(block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4, tma=True, wgmma=True)
    with pytest.raises(MoEConfigError, match="wgmma=True tiles take block_k=128"):
        cfg.TileConfig(**{**fields, **changes})


def test_wgmma_is_set_on_both_gemms_or_neither():
    plain = cfg.TileConfig(64, 128, tma=True)
    for gemm1, gemm2 in ((wgmma_tile(), plain), (plain, wgmma_tile())):
        with pytest.raises(MoEConfigError, match="on both GEMMs of a sorted config or on neither"):
            cfg.LaunchConfig(64, gemm1, gemm2)
    with pytest.raises(MoEConfigError, match="on both GEMMs of a sorted config or on neither"):
        cfg.LaunchConfig(16, wgmma_tile(), wgmma_tile(128), direct=True)
    config = cfg.LaunchConfig(64, wgmma_tile(), wgmma_tile(128))
    assert cfg.LaunchConfig.from_dict(config.to_dict()) == config  # the tables' JSON keeps the flag


def gather_with_scales(top_k: int, tokens: int = 5, hidden: int = 300, block_m: int = 16):
    """`gather_launch` with scales on a `BlockLayout` of ``tokens`` x ``top_k`` slots over 3 experts:
    (layout, source rows, source scales, gathered rows, gathered scales as [groups, rows])."""
    groups = -(-hidden // 128)
    ids = torch.stack([torch.randperm(3)[:top_k] for _ in range(tokens)]).int()
    layout = align_block_size_reference(ids, None, 3, block_m)
    rows = layout.sorted_slots.numel()
    src = torch.randint(0, 255, (tokens, hidden), dtype=torch.uint8)
    src_scale = torch.rand(tokens, groups)
    dst = torch.full((rows, hidden), 7, dtype=torch.uint8)
    dst_scale = torch.full((groups, rows), -1.0)
    gather_launch(src, layout, top_k, dst, (src_scale, dst_scale)).run()
    return layout, src, src_scale, dst, dst_scale


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_gather_copies_rows_and_transposes_scales(top_k):
    layout, src, src_scale, dst, dst_scale = gather_with_scales(top_k)
    ends, counts = layout.expert_ends.long(), layout.expert_counts.long()
    starts = ends - (counts + layout.block_m - 1) // layout.block_m * layout.block_m
    for start, count in zip(starts.tolist(), counts.tolist()):
        rows = torch.arange(start, start + count)
        source = layout.sorted_slots[rows].long() // top_k
        assert torch.equal(dst[rows], src[source])
        assert torch.equal(dst_scale[:, rows], src_scale[source].T)
        padding = torch.arange(start + count, start - (-count // layout.block_m) * layout.block_m)
        assert torch.equal(dst[padding], torch.full_like(dst[padding], 7))  # padding rows: not written
        assert torch.equal(dst_scale[:, padding], torch.full_like(dst_scale[:, padding], -1.0))


def test_workspace_holds_every_sorted_row_and_its_scales():
    p = make_problem("fp8_block", "silu", E=8, k=2, H=300, I=256, max_tokens=40)
    shapes = dict(TritonExperts(p).workspace_shapes(DispatchShape(ActivationFormat.STANDARD, 40)))
    rows = workspace_rows(80, 8)
    assert shapes["y"].shape == (rows, 300) and shapes["inter"].shape == (rows, 256)
    assert shapes["inter_q"].shape == (rows, 256) and shapes["inter_scale"].shape == (rows, 2)
    assert shapes["x_sorted_scale"].shape == (3 * rows,)


def test_wgmma_config_on_an_unquantized_problem_is_an_error(monkeypatch):
    p = make_problem("fp16", "silu", E=4, k=2, H=256, I=128, max_tokens=8)
    experts = TritonExperts(p)
    config = cfg.LaunchConfig(16, wgmma_tile(), wgmma_tile(128))
    monkeypatch.setattr(cfg.ConfigTable, "lookup", lambda self, m: config)
    x = torch.randn(8, 256, dtype=torch.float16)
    with pytest.raises(MoEConfigError, match="wgmma=True configs run fp8_block activations and weights"):
        run(experts, experts.prepare_weights(make_weights(p)), x, make_topk(8, p))


def test_wgmma_config_off_sm90_is_an_error(monkeypatch):
    """On the CPU (or any GPU but Hopper) a forced wgmma tile is a clear error, not an interpreter crash."""
    tokens = 160  # 320 slots: past the decode kernels, which take fp8_block up to 256 slots
    p = make_problem("fp8_block", "silu", E=4, k=2, H=256, I=128, max_tokens=tokens)
    experts = TritonExperts(p)
    config = cfg.LaunchConfig(16, wgmma_tile(), wgmma_tile(128))
    monkeypatch.setattr(cfg.ConfigTable, "lookup", lambda self, m: config)
    x = torch.randn(tokens, 256, dtype=torch.float16)
    with pytest.raises(MoEConfigError, match="wgmma=True tiles run on SM90 GPUs .*not on cpu"):
        run(experts, experts.prepare_weights(make_weights(p)), x, make_topk(tokens, p))


def test_wgmma_weight_descriptors_are_built_at_load_once():
    """A table's wgmma tiles get the Gluon kind of weight descriptor when the weights are prepared, kept with
    them like the Triton kind: no descriptor is made per launch."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper", reason="needs Triton with Gluon")
    p = make_problem("fp8_block", "silu", E=4, k=2, H=256, I=128, max_tokens=8)
    table = cfg.ConfigTable(config_key(p, "standard", torch.device("cpu")),
                            ((64, cfg.LaunchConfig(64, wgmma_tile(), wgmma_tile(128))),))
    prepared = prepare_triton_weights(make_weights(p), None, table)
    assert set(prepared.w13.descriptors) == {(64, 128, "gluon")}
    assert set(prepared.w2.descriptors) == {(128, 128, "gluon")}
    gluon = prepared.w13.descriptors[(64, 128, "gluon")]
    assert prepared.w13.descriptor(64, 128, gluon=True) is gluon and gluon.layout is not None
    assert gluon.shape == [4 * 256, 256] and gluon.block_shape == [64, 128]


def test_tuner_offers_wgmma_configs_for_fp8_block_on_sm90_only():
    from moe.tools.tune import wgmma_candidates

    configs = wgmma_candidates("fp8_block", 256.0, (9, 0))
    assert configs and all(c.gemm1.wgmma and c.gemm2.wgmma and c.block_m >= 64 for c in configs)
    assert len(set(configs)) == len(configs)
    assert wgmma_candidates("bf16", 256.0, (9, 0)) == []
    assert wgmma_candidates("fp8_block", 256.0, (8, 0)) == []  # no wgmma before Hopper
    assert wgmma_candidates("fp8_block", 256.0, (10, 0)) == []  # Blackwell: another MMA
    assert wgmma_candidates("fp8_block", 4.0, (9, 0)) == []  # decode: the 64-row blocks would be padding


VARIANTS = [
    {},  # Qwen3's GEMM1 tile: gated, 64 x (2 x 64), 4 warps
    {"BLOCK_M": 128, "num_warps": 8},
    {"BLOCK_N": 32, "STAGES": 6, "ACTIVATION": 3, "HAS_BIAS": True},  # GPT-OSS-like: swiglu_oai and biases
    {"GATED": False, "ACTIVATION": 0, "OUT_SORTED": False, "BLOCK_N": 128},  # GEMM2
    {"GATED": False, "ACTIVATION": 0, "OUT_SORTED": False, "BLOCK_N": 256, "num_warps": 8, "E_PAD": 32},
]


@pytest.fixture(scope="module")
def compiled_variants():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="needs Triton with Gluon")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "moe.testing.gluon_compile", json.dumps(VARIANTS)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) or "default")
def test_wgmma_kernel_compiles_for_sm90_with_its_wgmmas_pipelined(compiled_variants, variant):
    report = compiled_variants[json.dumps(variant, sort_keys=True)]
    assert "error" not in report, report.get("error")
    assert report["wgmma"] > 0
    # ptxas serializes every wgmma of a kernel when an in-flight accumulator is read (its C7514 note):
    # the overlap this kernel exists for would be gone
    assert not report["serialized"]
    assert report["spill_bytes"] == 0 and report["registers"] <= 255
