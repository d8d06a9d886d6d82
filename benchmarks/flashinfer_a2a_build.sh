#!/usr/bin/env bash
# FlashInfer's MoE all-to-all module (`flashinfer.comm.MoeAlltoAll`, JIT module mnnvl_moe_alltoall), built once
# on a GPU machine and carried like .gpu's CUTLASS module, so `flashinfer_a2a` does not JIT-compile on first use.
# One GPU is enough to compile. On the GPU machine, with .gpu/setup.sh sourced:
#
#   bash benchmarks/flashinfer_a2a_build.sh build OUTDIR      # -> OUTDIR/mnnvl_moe_alltoall.so.xz, build.log
#   bash benchmarks/flashinfer_a2a_build.sh install FILE.xz   # where FlashInfer loads prebuilt (AOT) modules
#
# The module's Python side (flashinfer.comm.mnnvl) imports pynvml and cuda.bindings, which the GPU machine
# lacks; on this machine, before a device call (setup.sh installs every wheel in .gpu/wheels):
#
#   bash benchmarks/flashinfer_a2a_build.sh wheels .gpu/wheels  # nvidia-ml-py, cuda-python 13.0 (no sources)
#
# `build` runs in the foreground and prints the build time and the module's size; put it under `setsid nohup`
# and poll OUTDIR/build.log when a call's time limit is shorter than the build.
set -euo pipefail
mode=${1:?usage: build OUTDIR | install FILE.xz | wheels DIR}
path_of() {  # the module's JIT or AOT path, from FlashInfer itself
  python3 -c "from flashinfer.jit.comm import gen_moe_alltoall_module as g; s = g(); print(s.$1)"
}
case "$mode" in
  build)
    out=${2:?OUTDIR}; mkdir -p "$out"
    start=$(date +%s)
    MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 -c "
from flashinfer.jit.comm import gen_moe_alltoall_module
gen_moe_alltoall_module().build_and_load()" 2>&1 | tee "$out/build.log"
    so=$(path_of jit_library_path)
    xz -T0 -c "$so" > "$out/mnnvl_moe_alltoall.so.xz"
    echo "BUILD DONE in $(( $(date +%s) - start )) s: $(stat -c %s "$so") bytes, $(stat -c %s "$out/mnnvl_moe_alltoall.so.xz") xz" | tee -a "$out/build.log"
    ;;
  install)
    aot=$(path_of aot_path); mkdir -p "$(dirname "$aot")"
    xz -dc "${2:?FILE.xz}" > "$aot"
    echo "installed $aot"
    ;;
  wheels)
    dest=${2:?DIR}; mkdir -p "$dest"
    for spec in nvidia-ml-py "cuda-python==13.0.*" "cuda-bindings==13.0.*" cuda-pathfinder; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$dest" "$spec"
    done
    python3 "$(dirname "$0")/slim_wheel.py" "$dest"/cuda_bindings-*.whl
    ;;
  *) echo "usage: build OUTDIR | install FILE.xz | wheels DIR" >&2; exit 2 ;;
esac
