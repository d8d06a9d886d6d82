#!/bin/bash
# The FlashInfer experts' GPU evidence, on the lent SM90 machine (carry [".gpu"], see shared/GPU.md):
#   bash benchmarks/flashinfer_gpu.sh tests bench
# Logs and JSON go to $OUT. Each step has its own time limit so one slow step cannot eat the call.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source .gpu/setup.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests) timeout "${TEST_LIMIT:-280}" python3 -m pytest -q -s -m gpu tests/gpu/test_flashinfer_gpu.py -p no:cacheprovider \
             >"$OUT/flashinfer_gpu_tests.log" 2>&1; echo "pytest rc=$?"
           grep -a "relative error" "$OUT/flashinfer_gpu_tests.log"; tail -25 "$OUT/flashinfer_gpu_tests.log" ;;
    bench) timeout "${BENCH_LIMIT:-260}" python3 benchmarks/flashinfer_bench.py --preset gpt-oss-20b --quant mxfp4,bf16 \
             --tokens "${TOKENS:-1,16,64,256,1024,4096}" --json "$OUT/flashinfer_bench.json" \
             >"$OUT/flashinfer_bench.log" 2>&1; echo "bench rc=$?"; tail -30 "$OUT/flashinfer_bench.log" ;;
    extra) # finer bf16 crossover, and the default (untuned) tactics for comparison
           timeout 150 python3 benchmarks/flashinfer_bench.py --quant bf16 --tokens 64,96,128,160,192,256 \
             --json "$OUT/flashinfer_bench_crossover.json" >"$OUT/flashinfer_bench_crossover.log" 2>&1; echo "rc=$?"
           grep -a "crossover\|^|" "$OUT/flashinfer_bench_crossover.log"
           timeout 150 python3 benchmarks/flashinfer_bench.py --quant mxfp4,bf16 --experts flashinfer_cutlass --no-tune \
             --json "$OUT/flashinfer_bench_untuned.json" >"$OUT/flashinfer_bench_untuned.log" 2>&1; echo "rc=$?"
           grep -a "^|" "$OUT/flashinfer_bench_untuned.log" ;;
  esac
done
