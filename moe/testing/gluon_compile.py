"""Compile the Gluon GEMMs (`moe_gemm_fp8_wgmma_kernel`, `moe_gemm_ws_kernel`, `moe_gemm_fp8_ws_kernel`) for sm90
on any machine, and report what ptxas says.

Gluon kernels do not run under Triton's CPU interpreter, so this is how a CPU machine checks them: the
installed Triton's frontend and its bundled ptxas, as in tests/test_triton_compiles_for_gpu.py. Run it in a
process of its own (``python -m moe.testing.gluon_compile '<variants as JSON>'``): ``TRITON_INTERPRET`` must
be off when the kernel module is imported, and `main` turns it off. Prints one JSON line: per variant, the
registers, the spilled bytes, whether ptxas serialized the wgmmas (its C7514 "Potential Performance Loss"
note), the wgmmas, the TMA stores and the cp.async row copies in the PTX, or the error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

DEFAULTS = dict(GATED=True, ACTIVATION=1, HAS_BIAS=False, OUT_SORTED=True, E_PAD=128, BLOCK_M=64, BLOCK_N=64,
                GROUP_M=8, STAGES=4, num_warps=4)
# the kernels: (module, name, its extra defaults, the operands' element type and Gluon name, block_k)
KERNELS = {
    "fp8": ("_gemm_wgmma", "moe_gemm_fp8_wgmma_kernel", {}, "fp8e4nv", "float8e4nv", 128),
    "ws": ("_gemm_ws", "moe_gemm_ws_kernel", dict(BLOCK_K=64, TMA_STORE=False, GATHER=False, A_ROW_DIV=1), "bf16",
           "bfloat16", 64),
    "fp8_ws": ("_gemm_ws", "moe_gemm_fp8_ws_kernel", dict(TMA_STORE=False), "fp8e4nv", "float8e4nv", 128),
}


def _signature(fn, consts: dict, kernel: str) -> dict:
    from triton.experimental.gluon import language as gl

    _, _, _, element, gl_name, default_k = KERNELS[kernel]
    block_k = consts.get("BLOCK_K", default_k)

    def desc(rows: int, cols: int = block_k, element: str = element, gl_name: str = gl_name) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], getattr(gl, gl_name))
        return f"tensordesc<{element}[{rows}, {cols}],{layout!r}>"

    # the output's (bf16), as the launch makes it for a TMA store
    out_desc = desc(consts["BLOCK_M"], consts["BLOCK_N"], "bf16", "bfloat16")
    types = {"a_desc": desc(consts["BLOCK_M"]), "w_desc": desc(consts["BLOCK_N"]), "out_desc": out_desc,
             "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "x_ptr": "*bf16",
             "alpha": "fp32", "beta": "fp32", "limit": "fp32"}
    return {n: "constexpr" if n in consts else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
            for n in fn.arg_names}


def _ptxas() -> str:
    """The ptxas the installed Triton uses for sm90 (Triton 3.9 bundles a newer one as ``ptxas-blackwell``)."""
    from triton.backends.nvidia import compiler

    if hasattr(compiler, "get_ptxas"):
        return compiler.get_ptxas(90).path
    from triton import knobs

    return knobs.nvidia.ptxas.path


def compile_variant(overrides: dict) -> dict:
    """The ptxas report of one variant: ``overrides["kernel"]`` (a `KERNELS` key, "fp8" by default) and its
    `DEFAULTS` updated by the other keys (``maxnreg`` a launch option, as at launch)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    overrides = dict(overrides)
    kernel_kind = overrides.pop("kernel", "fp8")
    options = {"maxnreg": overrides.pop("maxnreg")} if "maxnreg" in overrides else {}
    module, name, extra, *_ = KERNELS[kernel_kind]
    fn = getattr(importlib.import_module(f"moe.experts._triton.{module}"), name)
    consts = {**DEFAULTS, **extra, **overrides}
    if kernel_kind in ("ws", "fp8_ws") and "LOADER_REGS" not in consts:  # the loader's registers, as the launch sets
        from moe.experts._triton.gemm_ws import GATHER_LOADER_REGS, LOADER_REGS

        consts["LOADER_REGS"] = GATHER_LOADER_REGS if consts.get("GATHER") else LOADER_REGS
    # the gathering loader's cp.async copies need x_ptr known 16-byte aligned, as Triton's launcher specializes
    # a 16-byte-aligned pointer argument (torch's allocations are)
    attrs = {(fn.arg_names.index("x_ptr"),): [["tt.divisibility", 16]]} if "x_ptr" in fn.arg_names else {}
    source = GluonASTSource(fn=fn, signature=_signature(fn, consts, kernel_kind),
                            constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 128),
                            options=dict(num_warps=consts["num_warps"], **options))
    ptxas = _ptxas()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(folder, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "serialized": "C7514" in log or "wgmma.mma_async instructions are serialized" in log,
            "wgmma": kernel.asm["ptx"].count("wgmma.mma_async"),
            # TMA stores of a staged tile (shared -> global), and the waits before the staging buffer is reused
            "tma_stores": kernel.asm["ptx"].count("cp.async.bulk.tensor.2d.global.shared::cta"),
            "store_waits": kernel.asm["ptx"].count("cp.async.bulk.wait_group"),
            # the gathering loader's row copies, and its threads' arrivals on the ring's barrier once they land
            "row_copies": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", kernel.asm["ptx"])),
            "copy_arrivals": kernel.asm["ptx"].count("cp.async.mbarrier.arrive.noinc")}


def main(argv: list[str]) -> None:
    # before the kernel module is imported: @gluon.jit and @triton.jit read it when they decorate. Set here,
    # not at import, so that importing this module (as tests that import every module do) changes nothing
    os.environ["TRITON_INTERPRET"] = "0"
    report = {}
    for overrides in json.loads(argv[0]):
        try:
            report[json.dumps(overrides, sort_keys=True)] = compile_variant(overrides)
        except Exception as error:  # noqa: BLE001 -- reported to the caller, which fails the test
            report[json.dumps(overrides, sort_keys=True)] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
