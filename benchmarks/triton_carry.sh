#!/usr/bin/env bash
# Another Triton on the GPU machine, which has only its own (3.6.0) and no network: a slimmed wheel carried in a
# device call, for trying our kernels on a newer Triton (Gluon's multi-CTA TMA multicast is 3.9+) before anything
# depends on it. On this machine, from the project root:
#
#   bash benchmarks/triton_carry.sh prepare [VERSION]   # -> .triton/ (git-ignored): triton.tar.xz, setup.sh
#
# then a device call with `carry: [".triton"]` whose command starts with `source .triton/setup.sh && ...`: it
# unpacks the package under /tmp and puts it first on PYTHONPATH, with the machine's CUDA ptxas (the wheel's own
# binaries are left out). `.triton` must fit the call's 64 MiB with the tree; 3.9.0 packs to about 40 MB, so it does
# not travel together with `.gpu` (FlashInfer).
#
# Slimming: the cp312 wheel (the GPU machine's Python), less the AMD backend (and its entry point), the CUDA tools
# (ptxas, ptxas-blackwell, cuobjdump, nvdisasm), CUPTI, the profiler (proton) and the instrumentation test library;
# libtriton.so stripped of its symbols (500 MB -> ~190 MB for 3.9.0).
set -euo pipefail
mode=${1:?usage: prepare [VERSION]}
case "$mode" in
  prepare)
    version=${2:-3.9.0}
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python3 -m pip download "triton==$version" --python-version 3.12 --platform manylinux_2_27_x86_64 \
      --only-binary=:all: --no-deps -q -d "$work"
    mkdir "$work/site"
    (cd "$work/site" && python3 -m zipfile -e "$work"/triton-"$version"-*.whl .)
    rm -rf "$work/site/triton/backends/amd" "$work/site/triton/backends/nvidia/bin" \
      "$work/site/triton/backends/nvidia/lib"/cupti* "$work/site/triton/profiler" \
      "$work/site/triton/instrumentation" "$work/site/triton/_C/libproton.so"
    # the wheel names its backends as entry points, and Triton imports each one it names
    sed -i '/^amd = triton.backends.amd$/d' "$work/site"/triton-"$version".dist-info/entry_points.txt
    strip --strip-unneeded "$work/site/triton/_C/libtriton.so"
    mkdir -p .triton
    grep -qx '/.triton/' .git/info/exclude 2>/dev/null || echo '/.triton/' >> .git/info/exclude
    tar -C "$work/site" -cJf .triton/triton.tar.xz .
    cat > .triton/setup.sh <<SETUP
# sourced in a device call: Triton $version first on PYTHONPATH, compiling with the machine's ptxas
mkdir -p /tmp/triton-carry && tar -C /tmp/triton-carry -xJf .triton/triton.tar.xz
export PYTHONPATH=/tmp/triton-carry\${PYTHONPATH:+:\$PYTHONPATH}
export TRITON_PTXAS_PATH=\${TRITON_PTXAS_PATH:-\$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}
export TRITON_PTXAS_BLACKWELL_PATH=\${TRITON_PTXAS_BLACKWELL_PATH:-\$TRITON_PTXAS_PATH}  # 3.9 looks for it on SM90 too
export TRITON_CACHE_DIR=/tmp/triton-carry-cache  # kernels of another Triton never mix with 3.6's cache
SETUP
    du -sh .triton
    ;;
  *) echo "usage: prepare [VERSION]" >&2; exit 2 ;;
esac
