"""Every Triton kernel of `moe`, as our launchers launch it, compiles for the GPU (sm90; sm80 where the
variant runs on an A100) -- checked on a CPU, with the installed Triton's frontend and ptxas.

The CPU interpreter accepts code that Triton compiling for a GPU rejects (a plain-Python global in a
kernel, a constexpr early return followed by code of another type), so a kernel can pass every CPU
test and fail on the first GPU launch. Here the `SCENARIOS` run the real launchers on CPU at tiny
shapes under the interpreter while `record_launches` records each launch's types, constexprs and
options; each distinct launch then compiles for the GPU, in its recorded dtype and, where it ran in
float16, in bfloat16 (see moe/testing/triton_launches.py). A ``@triton.jit`` function that no
recorded launch reaches fails the test: a new kernel needs its launch in `SCENARIOS` (one line).

Cost: ~15 s of recording and 201 compile jobs (session 8: 84 full compiles for sm90 at ~0.4 s, 18 for
sm80, 99 frontends at ~0.03 s) in two worker processes, which compile while the scenarios record. With
Triton's cache (~/.triton) holding the unchanged kernels it took 21-25 s; a cold cache compiles them all.
"""

import os
import shutil

if not shutil.which("nvidia-smi"):  # a CPU machine: the interpreter, before triton decorates any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="compiles Triton kernels: needs triton installed")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("records launches on the CPU under TRITON_INTERPRET=1; on a GPU the kernels compile when they run",
                allow_module_level=True)

import moe  # noqa: E402
from moe.experts._triton import config as cfg  # noqa: E402
from moe.experts._triton.align import align_block_size  # noqa: E402
from moe.experts._triton.align import workspace_buffers as align_buffers  # noqa: E402
from moe.experts._triton.gemm import ACTIVATION_CODES, QUANT_CODES, ROW_CODES  # noqa: E402
from moe.experts._triton.decode import DecodeConfig, DecodeTile  # noqa: E402
from moe.experts._triton.rows import FP8_MODES  # noqa: E402
from moe.experts._triton.support import config_key  # noqa: E402
from moe.experts._triton.weights import prepare_triton_weights  # noqa: E402
from moe.quant import QuantFormat  # noqa: E402
from moe.experts.triton import TritonExperts  # noqa: E402
from moe.experts.triton_batched import TritonBatchedExperts  # noqa: E402
from moe.prepare_finalize.batched import BatchedPrepareFinalize  # noqa: E402
from moe.routing import SCORE_NAMES  # noqa: E402
from moe.routing.fused import fused_route  # noqa: E402
from moe.testing import triton_launches as launches  # noqa: E402
from moe.workspace import WorkspaceManager, WorkspaceShapes  # noqa: E402
from tests.test_routing_kernel import ROUTERS  # noqa: E402
from tests.test_triton import make_problem, make_topk, make_weights, run_experts  # noqa: E402
from tests.test_triton_weight_only import run as run_prepared  # noqa: E402
from tests.test_triton_wgmma import gather_with_scales  # noqa: E402

BOTH = {False, True}


# --- the launches: representative calls of every launcher ----------------------------------------


def tile(block_n=32, block_k=64, tma=False):
    return cfg.TileConfig(block_n, block_k, tma=tma)


TMA = cfg.LaunchConfig(16, tile(tma=True), tile(64, 32, tma=True))
TMA_A = cfg.LaunchConfig(64, *[cfg.TileConfig(64, 64, tma=True, tma_a=True)] * 2)
TMA_A_GEMM1 = cfg.LaunchConfig(64, cfg.TileConfig(64, 32, tma=True, tma_a=True), tile(64, 32, tma=True))
EP_MAP = (-1, 0, -1, -1, 1, -1, 2, -1)  # experts 1, 4, 6 of 8 live here


def standard(quant, activation="silu", tokens=5, *, config=None, weight_only=False, grouped=False, **problem):
    """`TritonExperts` (align, fp8 quantization, both GEMMs, combine) on ``tokens`` tokens; ``config``
    replaces the table's (else the default for M), ``weight_only`` prepares fp8 as for an A100, ``grouped``
    keeps fp4 and fp8 weights on the grouped GEMM where the decode kernels would take a few tokens."""
    p = make_problem(quant, activation, **problem)
    experts = TritonExperts(p)
    if weight_only:
        expert_map = p.parallel.global_to_local(p.num_experts) if p.parallel.enabled else None
        table = cfg.ConfigTable.load(config_key(p, "standard", torch.device("cpu")))
        prepared = prepare_triton_weights(make_weights(p), expert_map, table, weight_only=True)
    else:
        prepared = experts.prepare_weights(make_weights(p))
    patch = mock.patch.object(cfg.ConfigTable, "lookup", lambda self, m: config) if config else nullcontext()
    no_decode = mock.patch("moe.experts.triton.uses_decode", lambda *a: False) if grouped else nullcontext()
    with patch, no_decode:
        run_prepared(experts, prepared, torch.randn(tokens, p.hidden_size).to(p.dtype), make_topk(tokens, p))


FMA_TILE = DecodeTile(32, 64, 2, 1, dot=False, finish=True)  # the split epilogue in the GEMMs (FINISH 1, 2)
FMA_TILES = DecodeConfig(FMA_TILE, FMA_TILE)
DOT_TILES = DecodeConfig(DecodeTile(32, 64, 1, 16, dot=True), DecodeTile(32, 64, 2, 16, dot=True))
# split tensor-core tiles keep both epilogue launches (FMA tiles, one row per program, finish their own) but for
# one token with ``finish``
DOT_SPLIT_TILES = DecodeConfig(DecodeTile(32, 64, 2, 16, dot=True), DecodeTile(32, 64, 2, 16, dot=True))
DOT_FINISH_TILES = DecodeConfig(DecodeTile(32, 128, 2, 16, dot=True, finish=True),
                                DecodeTile(32, 128, 2, 16, dot=True, finish=True))
TMA_FINISH_TILES = DecodeConfig(*(replace(t, tma=True) for t in (DOT_FINISH_TILES.gemm1, DOT_FINISH_TILES.gemm2)))


def decode(tokens, config, activation="swiglu_oai", quant="mxfp4"):
    """The fp4 or fp8_block decode kernels (`_triton/decode.py`, M * k <= 256) under ``config``: gemm, the
    split sums' epilogues, and for more than one token the unpadded alignment."""
    with mock.patch("moe.experts.triton.decode_config", lambda m, *table: config), \
            mock.patch("moe.experts.triton.fp8_decode_config", lambda m, *table: config):
        standard(quant, activation, tokens=tokens, bias=activation == "swiglu_oai")


def batched(quant, activation="silu", tokens=5, **problem):
    """`TritonBatchedExperts` on what `BatchedPrepareFinalize` dispatches (rows per expert)."""
    p = make_problem(quant, activation, max_tokens=8, **problem)  # 8 rows per expert: fewer programs
    prepare = BatchedPrepareFinalize(p)
    workspace = WorkspaceManager().take(prepare.workspace_shapes(tokens))
    x = torch.randn(tokens, p.hidden_size).to(p.dtype)
    dispatched, _ = prepare.prepare(x, make_topk(tokens, p), p.quant.activation, workspace)
    run_experts(TritonBatchedExperts(p), dispatched, make_weights(p))


def align(slots, with_map):
    """`align_block_size` alone: past FUSED_MAX_SLOTS it takes two launches (rank, then place)."""
    num_experts, k = 8, 4
    ids = torch.stack([torch.randperm(num_experts)[:k] for _ in range(slots // k)]).int()
    expert_map = torch.tensor(EP_MAP, dtype=torch.int32) if with_map else None
    num_local = 3 if with_map else num_experts
    workspace = WorkspaceManager().take(WorkspaceShapes.of(**align_buffers(ids.numel(), num_local, (64,))))
    align_block_size(ids, expert_map, num_local, 64, workspace)


ROUTINGS = ("softmax", "gpt_oss", "deepseek_v3", "deepseek_v4", "llama4", "longcat_flash")  # a router per kind


def route(name, dtype=torch.float32):
    """`fused_route` of router ``name`` (tests/test_routing_kernel.py's) on 3 tokens' ``dtype`` logits."""
    router = ROUTERS[name]
    fused_route(torch.randn(3, router.num_choices).to(dtype), router)


# One line per call; a new kernel's launcher needs one here (test_every_kernel_is_launched says which).
# Together they launch every value of every switch in SWITCHES (test_every_switch_value_is_launched).
SCENARIOS = {
    "fp16 silu sorted": lambda: standard("fp16"),
    "fp16 gelu 130 rows/expert": lambda: standard("fp16", "gelu", tokens=130, E=2, max_tokens=130),  # prefill tiles
    "fp32 silu direct expert map bias": lambda: standard("fp32", tokens=2, E=8, k=3, expert_map=EP_MAP, bias=True),
    "fp8 tensor": lambda: standard("fp8"),
    "fp8 row": lambda: standard("fp8_token", "relu2", grouped=True),
    "fp8 token decode grouped fma": lambda: decode(3, FMA_TILES, activation="silu", quant="fp8_token"),
    "fp8 block expert map": lambda: standard("fp8_block", E=8, expert_map=EP_MAP, grouped=True),
    "fp8 block decode one token fma": lambda: decode(1, FMA_TILES, activation="silu", quant="fp8_block"),
    "fp8 block decode one token dot finish": lambda: decode(1, DOT_FINISH_TILES, activation="silu", quant="fp8_block"),
    "fp8 block decode one token tma finish": lambda: decode(1, TMA_FINISH_TILES, activation="silu", quant="fp8_block"),
    "fp8 block decode grouped dot relu2": lambda: decode(3, DOT_TILES, activation="relu2", quant="fp8_block"),
    "mxfp4 swiglu_oai bias": lambda: standard("mxfp4", "swiglu_oai", bias=True),
    "nvfp4 weight-only": lambda: standard("nvfp4", grouped=True),
    "nvfp4 weight-only decode split": lambda: decode(2, DOT_SPLIT_TILES, activation="silu", quant="nvfp4"),
    "fp8 tensor weight-only": lambda: standard("fp8", weight_only=True),
    "fp8 row weight-only direct": lambda: standard("fp8_token", tokens=3, weight_only=True),
    "fp8 block weight-only": lambda: standard("fp8_block", "relu2", weight_only=True),
    "mxfp8 weight-only swiglu_oai bias": lambda: standard("mxfp8", "swiglu_oai", bias=True, grouped=True),
    "mxfp8 weight-only direct": lambda: standard("mxfp8", tokens=2, grouped=True),
    "mxfp8 weight-only decode one token fma": lambda: decode(1, FMA_TILES, activation="silu", quant="mxfp8"),
    "mxfp8 weight-only decode grouped dot bias": lambda: decode(3, DOT_TILES, quant="mxfp8"),
    "fp16 silu TMA": lambda: standard("fp16", config=TMA),
    "fp8 block TMA": lambda: standard("fp8_block", config=TMA, grouped=True),
    "fp16 silu tma_a": lambda: standard("fp16", config=TMA_A),
    "fp32 relu2 tma_a gemm1 expert map bias": lambda: standard("fp32", "relu2", config=TMA_A_GEMM1, E=8, k=3,
                                                               expert_map=EP_MAP, bias=True),
    "mxfp4 decode one token fma": lambda: decode(1, FMA_TILES),
    "mxfp4 decode grouped dot, one split": lambda: decode(3, DOT_TILES, activation="silu"),
    "batched fp8 tensor": lambda: batched("fp8"),
    "batched mxfp4": lambda: batched("mxfp4", "swiglu_oai", bias=True),
    "gather fp8 rows with their scales (wgmma tiles)": lambda: gather_with_scales(top_k=2),
    "align two launches": lambda: align(4100, with_map=False),
    "align two launches expert map": lambda: align(4100, with_map=True),
    **{f"route {name}": (lambda name=name: route(name)) for name in ROUTINGS},
    "route softmax fp16": lambda: route("softmax", torch.float16),
    "route deepseek_v3 fp16": lambda: route("deepseek_v3", torch.float16),
}

# The switches whose every value some scenario must launch: a scheme whose calls stop reaching a
# kernel (another path took them) fails here rather than going unchecked.
GEMM = "moe.experts._triton._gemm.moe_gemm_kernel"
TMA_A_GEMM = "moe.experts._triton._gemm_tma_a.moe_gemm_tma_a_kernel"
SWITCHES = {
    GEMM: {"ROWS": set(ROW_CODES.values()), "QUANT": set(QUANT_CODES.values()),
           "ACTIVATION": set(ACTIVATION_CODES.values()), "GATED": BOTH, "WEIGHT_ONLY": BOTH, "HAS_BIAS": BOTH,
           "HAS_MAP": BOTH, "EVEN_K": BOTH, "IEEE": BOTH, "W_TMA": BOTH},
    TMA_A_GEMM: {"GATED": BOTH, "OUT_SORTED": BOTH, "HAS_BIAS": BOTH, "IEEE": BOTH},
    "moe.experts._triton._gemm_tma_a.gather_rows_kernel": {"A_ROW_DIV": {2, 3}, "HAS_SCALES": BOTH},
    "moe.experts._triton._rows.fp8_quant_kernel": {"MODE": set(FP8_MODES.values()), "VALID": {0, 1, 2}},
    "moe.experts._triton._rows.combine_kernel": {"CHECK_LOCAL": BOTH},
    "moe.experts._triton._align.align_fused_kernel": {"HAS_MAP": BOTH},
    "moe.experts._triton._align.rank_kernel": {"HAS_MAP": BOTH},
    "moe.experts._triton._decode.decode_gemm_kernel": {"DOT": BOTH, "GROUPED": BOTH, "FUSED": BOTH, "FINISH": {0, 1, 2},
                                                       "TMA": BOTH,
                                                       "SCALES": {QUANT_CODES[QuantFormat.MXFP4],
                                                                  QUANT_CODES[QuantFormat.NVFP4],
                                                                  QUANT_CODES[QuantFormat.MXFP8],
                                                                  QUANT_CODES[QuantFormat.FP8_BLOCK],
                                                                  QUANT_CODES[QuantFormat.FP8_ROW]}},
    "moe.routing._fused.route_kernel": {"SCORE": set(range(len(SCORE_NAMES))), "ON_LOGITS": BOTH,
                                        "HAS_BIAS": BOTH, "RENORMALIZE": BOTH},
}


# --- recording and compiling, once per run ---------------------------------------------------------


@pytest.fixture(scope="module")
def launched() -> tuple[list, dict]:
    """(the distinct records, {compile job: error or None}); each scenario's launches compile while
    the next one records."""
    with launches.Compiler() as compiler, launches.record_launches() as recorded:
        for run in SCENARIOS.values():
            run()
            compiler.submit(recorded)
        return list(dict.fromkeys(recorded)), compiler.results()


@pytest.fixture(scope="module")
def records(launched) -> list:
    return launched[0]


@pytest.fixture(scope="module")
def compiled(launched) -> dict:
    return launched[1]


def test_every_kernel_is_launched(records):
    graph = launches.jit_functions(Path(moe.__file__).parent)
    missing = launches.unreached(graph, {r.name for r in records})
    assert not missing, f"@triton.jit functions no scenario launches or calls; add their launch to SCENARIOS: {missing}"
    assert GEMM in graph and len(graph) > 30  # the search found the package's kernels


def test_every_switch_value_is_launched(records):
    for kernel, switches in SWITCHES.items():
        for switch, wanted in switches.items():
            seen = {dict(r.constexprs)[switch] for r in records if r.name == kernel}
            assert wanted <= seen, f"{kernel}: no scenario launches {switch} = {sorted(wanted - seen)}"


def _reason(error: str) -> str:
    """A CompilationError's place (its first line) and cause (its last)."""
    lines = [line for line in error.splitlines() if line.strip()]
    return " ... ".join(dict.fromkeys([lines[0], lines[-1]]))


def test_every_launch_compiles_for_the_gpu(compiled):
    failures = [f"{job.describe()}\n    {_reason(error)}" for job, error in compiled.items() if error]
    assert not failures, f"{len(failures)} of {len(compiled)} launches do not compile:\n" + "\n".join(failures)
    assert {(job.arch, job.full) for job in compiled} == {(90, True), (90, False), (80, True), (80, False)}
    assert any("*bf16" in dict(job.record.signature).values() for job in compiled)  # the bfloat16 twins


def test_the_packed_nvfp4_decode_compiles_for_both_archs(compiled):
    """NVFP4's bf16x2 PTX path (ASM, switched on in the bfloat16 twins) is among the full compiles, sm90 and sm80."""
    nvfp4 = QUANT_CODES[QuantFormat.NVFP4]
    archs = {job.arch for job, error in compiled.items()
             if job.full and error is None and job.record.name == "moe.experts._triton._decode.decode_gemm_kernel"
             and dict(job.record.constexprs).get("ASM") is True and dict(job.record.constexprs)["SCALES"] == nvfp4}
    assert archs == {80, 90}


def mma_variant(record, scales: QuantFormat, finish: int):
    """A bfloat16 fp4 decode launch as an MMA-fragment tile would make it on a GPU (`_decode_mma`; the CPU never
    launches one: its weights carry no fragments)."""
    twin = launches.bfloat16_twin(record) or record
    values = dict(twin.constexprs) | dict(MMA=True, DOT=False, ASM=True, BLOCK_M=8, BLOCK_N=32, BLOCK_K=128,
                                          SCALES=QUANT_CODES[scales], FINISH=finish, GROUPED=finish == 0, FUSED=False)
    return replace(twin, constexprs=tuple(values.items()), options=(("num_warps", 2), ("num_stages", 1)))


@pytest.mark.parametrize("scales, finish", [(QuantFormat.MXFP4, 0), (QuantFormat.NVFP4, 0), (QuantFormat.MXFP4, 1)])
def test_the_mma_decode_tiles_compile_with_one_element_per_thread(records, scales, finish):
    """The MMA tiles' PTX addresses lanes, which holds only if Triton gives their tensors one element per thread
    (element i on thread i): every inline-asm op in one layout of sizePerThread 1 over 32 threads per warp, no
    layout conversion, no shared memory staging; on sm90 and sm80 (mma.sync and the bf16x2 fma are SM80+)."""
    base = next(r for r in records if r.name == "moe.experts._triton._decode.decode_gemm_kernel"
                and dict(r.constexprs)["GATED"] and dict(r.constexprs)["SCALES"] == QUANT_CODES[QuantFormat.MXFP4])
    record = mma_variant(base, scales, finish)
    with launches.Compiler(workers=1) as compiler:
        results = [compiler.stage(launches.CompileJob(record, arch)) for arch in (90, 80)]
        for error, ttgir in (future.result() for future in results):
            assert error is None, error
            layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{(.*)\}>", ttgir, re.M))
            used = set(re.findall(r"tt\.elementwise_inline_asm .*?-> .*?(#blocked\d*)", ttgir))
            assert used and all("sizePerThread = [1], threadsPerWarp = [32]" in layouts[u] for u in used), \
                (used, layouts)
            assert "convert_layout" not in ttgir and "local_alloc" not in ttgir
            assert ttgir.count("mma.sync.aligned.m16n8k16") >= 1


def test_unpredicated_mma_tiles_load_their_weights_with_no_predicate(records):
    """``DecodeTile.unpredicated`` takes the predicate off the MMA tiles' weight and scale loads (sm90 PTX: bare
    ``ld.global.nc`` of 16 and 4 bytes, the activations' loads still predicated); without it every such load is
    predicated."""
    base = next(r for r in records if r.name == "moe.experts._triton._decode.decode_gemm_kernel"
                and dict(r.constexprs)["GATED"] and dict(r.constexprs)["SCALES"] == QUANT_CODES[QuantFormat.MXFP4])
    plain = mma_variant(base, QuantFormat.MXFP4, 1)
    assert dict(plain.constexprs)["UNPREDICATED"] is False  # what the recorded launches pass by default
    bare = replace(plain, constexprs=tuple((dict(plain.constexprs) | dict(UNPREDICATED=True)).items()))
    with launches.Compiler(workers=1) as compiler:
        (error, ptx), (plain_error, plain_ptx) = [compiler.stage(launches.CompileJob(r, 90), "ptx").result()
                                                  for r in (bare, plain)]
    assert error is None and plain_error is None, (error, plain_error)

    def loads(text: str, width: str) -> tuple[int, int]:
        lines = [line.strip() for line in text.splitlines() if f"ld.global.nc.{width}" in line]
        return sum(line.startswith("@") for line in lines), sum(not line.startswith("@") for line in lines)

    (predicated16, bare16), (_, bare4) = loads(ptx, "v4.b32"), loads(ptx, "b32 ")
    assert bare16 >= 2 and bare4 >= 2  # gate and up rows' words and scales
    assert predicated16 >= 2  # the activations
    assert loads(plain_ptx, "v4.b32")[1] == 0 and loads(plain_ptx, "b32 ")[1] == 0


def one_token_fp8_dot_record(records):
    """The fp8_block decode GEMM on tensor cores that finishes its own epilogue: what the one-token configs launch."""
    return next(r for r in records if r.name == "moe.experts._triton._decode.decode_gemm_kernel"
                and dict(r.constexprs)["SCALES"] == QUANT_CODES[QuantFormat.FP8_BLOCK] and dict(r.constexprs)["DOT"]
                and dict(r.constexprs)["FINISH"] != 0)


@pytest.mark.parametrize("pdl", [1, 2, 3], ids=["first", "second", "chained"])
def test_the_decode_gemms_compile_for_a_programmatic_dependent_launch(records, pdl):
    """On SM90 the decode GEMMs run as a programmatic dependent launch (`decode.pdl_roles`; the CPU never launches
    one): GEMM1 lets the next grid start after its K loop (griddepcontrol.launch_dependents), GEMM2 is launched so
    and waits for GEMM1 (griddepcontrol.wait); chained, GEMM1 does both (launched so after the routing kernel) --
    on an fp8 tensor-core tile that finishes its own epilogue, as the one-token configs do."""
    base = one_token_fp8_dot_record(records)
    values = dict(base.constexprs) | dict(PDL=pdl)
    record = replace(base, constexprs=tuple(values.items()),
                     options=tuple(dict(base.options, launch_pdl=pdl >= 2).items()))
    with launches.Compiler(workers=1) as compiler:
        error, ptx = compiler.stage(launches.CompileJob(record, 90), "ptx").result()
    assert error is None, error
    assert ("griddepcontrol.launch_dependents" in ptx) is (pdl in (1, 3))
    assert ("griddepcontrol.wait" in ptx) is (pdl in (2, 3))


def test_the_routing_kernel_compiles_to_let_the_next_launch_start(records):
    """On SM90 the routing kernel lets a programmatic dependent launch after it (a decode GEMM1, chained) start at
    once; the CPU's launches record it without."""
    base = next(r for r in records if r.name == "moe.routing._fused.route_kernel")
    assert dict(base.constexprs)["LAUNCH_DEPENDENTS"] is False
    record = replace(base, constexprs=tuple((dict(base.constexprs) | dict(LAUNCH_DEPENDENTS=True)).items()))
    with launches.Compiler(workers=1) as compiler:
        jobs = [compiler.stage(launches.CompileJob(r, 90), "ptx") for r in (record, base)]
        (error, ptx), (bare_error, bare_ptx) = [job.result() for job in jobs]
    assert error is None and bare_error is None, (error, bare_error)
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.launch_dependents" not in bare_ptx


def test_records_carry_what_a_launch_specializes_as_multiples_of_16(records):
    """A GPU launch tells the compiler which ints and tensor addresses are multiples of 16; the records carry it, so
    the compile here is the GPU's: the fp8 decode GEMM (one token, tensor cores) streams its weights through a
    ``cp.async`` ring, which it does not without the hint. ``do_not_specialize`` arguments stay unmarked."""
    base = one_token_fp8_dot_record(records)
    assert {"a_ptr", "w_ptr", "stride_wn"} <= set(base.divisible)  # bf16 activations, fp8 weights, K = 64 or 128
    assert "num_local" not in base.divisible  # do_not_specialize
    gpu = launches.bfloat16_twin(base) or base
    with launches.Compiler(workers=1) as compiler:
        hinted = compiler.stage(launches.CompileJob(gpu, 90), "ttgir")
        bare = compiler.stage(launches.CompileJob(replace(gpu, divisible=()), 90), "ttgir")
        (error, ttgir), (bare_error, bare_ttgir) = hinted.result(), bare.result()
    assert error is None and bare_error is None, (error, bare_error)

    def fp8_async_copies(ir: str) -> list[str]:
        return [line for line in ir.splitlines() if "async_copy_global_to_local" in line and "f8E4M3FN" in line]

    assert fp8_async_copies(ttgir), "no fp8 weight tile is copied asynchronously"
    assert not fp8_async_copies(bare_ttgir)


def test_launch_record_marks_multiples_of_16_but_not_bools_or_unspecialized_arguments():
    def kernel(a_ptr, n, m, flag, stride, BLOCK: "tl.constexpr"):  # noqa: F821 -- the annotation is only read
        pass

    x = torch.zeros(64)
    record = launches.launch_record(kernel, (x, 32, 33, True, 16), {"BLOCK": 8}, do_not_specialize=("stride",))
    assert record.divisible == ("a_ptr", "n")
    assert launches.launch_record(kernel, (x[1:], 48, 0, False, 3), {"BLOCK": 8}).divisible == ("n", "m")


def test_the_tma_decode_tiles_load_their_weights_by_tma(records):
    """``tma=True`` fp8 decode tiles (one token, finishing: the one-token configs' kind) compile for sm90 to TMA
    loads of the weight tiles in the K loop, waited on by mbarrier; the same tile without it has none."""
    tma = [r for r in records if r.name == "moe.experts._triton._decode.decode_gemm_kernel"
           and dict(r.constexprs)["TMA"] and dict(r.constexprs)["GATED"]]
    assert tma, "no gated tma=True decode launch recorded"
    plain = replace(tma[0], constexprs=tuple((dict(tma[0].constexprs) | dict(TMA=False)).items()))
    with launches.Compiler(workers=1) as compiler:
        (error, ptx), (plain_error, plain_ptx) = [compiler.stage(launches.CompileJob(r, 90), "ptx").result()
                                                  for r in (tma[0], plain)]
    assert error is None and plain_error is None, (error, plain_error)
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait" in ptx
    assert "cp.async.bulk.tensor" not in plain_ptx
