#!/bin/bash
# Issue 15's evidence in one device call on the 2-GPU kind (nvidia-h200-x2 or nvidia-h100-x2; carry [".gpu"]
# after ../shared/gpu/prepare, see shared/GPU.md):
#   bash benchmarks/ep_gpu.sh a2a tests bench pack
# a2a: the prebuilt FlashInfer all-to-all module (.gpu/mnnvl_moe_alltoall.so.xz, else built here, ~150 s);
# tests: tests/gpu/test_all_to_all_gpu.py (NCCL and flashinfer_a2a, both ranks checked against one GPU);
# bench: benchmarks/ep_all_to_all.py for DeepSeek-V3 (bf16, fp8_block) and Qwen3-30B-A3B (bf16) at EP2, with
# --save-profile (RUNS picks the runs); pack: $OUT in one archive. Logs, JSON and the profile go to $OUT.
# Each step has its own time limit.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source .gpu/setup.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
machine=${MACHINE:-nvidia-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h')-x2}
tokens=${TOKENS:-1,16,64,256,1024}
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    a2a) if [ -f .gpu/mnnvl_moe_alltoall.so.xz ]; then bash benchmarks/flashinfer_a2a_build.sh install .gpu/mnnvl_moe_alltoall.so.xz
         else timeout 400 bash benchmarks/flashinfer_a2a_build.sh build "$OUT" >"$OUT/a2a_build.log" 2>&1 \
                && bash benchmarks/flashinfer_a2a_build.sh install "$OUT/mnnvl_moe_alltoall.so.xz"; tail -2 "$OUT/a2a_build.log"
         fi ;;
    tests) timeout "${TEST_LIMIT:-400}" python3 -m pytest -q -s -m gpu tests/gpu/test_all_to_all_gpu.py -p no:cacheprovider \
             >"$OUT/ep_gpu_tests.log" 2>&1; echo "pytest rc=$?"; tail -25 "$OUT/ep_gpu_tests.log" ;;
    # RUNS: "preset:scheme:experts" words. fp8_block without flashinfer_cutlass: .gpu's reduced CUTLASS module
    # holds no FP8 instantiation (a stub aborts). triton_batched is what all_to_all_batched (NCCL, graphs) serves.
    bench) for run in ${RUNS:-deepseek-v3:bf16:triton,flashinfer_cutlass deepseek-v3:fp8_block:triton \
                               qwen3-30b-a3b:bf16:triton,flashinfer_cutlass deepseek-v3:bf16:triton_batched}; do
             IFS=: read -r preset quant experts <<<"$run"
             name=ep2_${preset}_${quant}_${experts//,/_}
             timeout "${BENCH_LIMIT:-280}" python3 benchmarks/ep_all_to_all.py --preset "$preset" --quant "$quant" \
               --ep 2 --tokens "$tokens" --experts "$experts" --machine "$machine" --json "$OUT/${name}_$machine.json" \
               --save-profile "$OUT/ep2_profile_$machine.yaml" >"$OUT/$name.log" 2>&1
             echo "$run rc=$?"; grep -a "^|" "$OUT/$name.log"
           done ;;
    # few files come back from a device call: everything in one archive
    pack) tar czf /tmp/ep_gpu.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/ep_gpu.tgz "$OUT/" ;;
  esac
done
