#!/bin/bash
# Runs steps of the Triton experts' GPU work on the device machine, logs and results under $OUT.
#   bash benchmarks/triton_gpu.sh info tests bench:bf16 tune:qwen3-30b-a3b:bf16:1,16,256 ...
# Each step has its own time limit so one slow step cannot eat the whole call.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=$OUT/work; mkdir -p "$W/configs"  # packed into $OUT/results.tgz by the "pack" step (few files come back)
cp moe/experts/_triton/configs/*.json "$W/configs/" 2>/dev/null  # tuning adds buckets to these
MACHINE=${MACHINE:-nvidia-h200}
PRESETS=${PRESETS:-qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,deepseek-v3-ep8-slice}
TOKENS=${TOKENS:-1,16,256,1024,4096,16384}
for step in "$@"; do
  IFS=: read -r what a b c <<<"$step"
  echo "=== $step ($(date +%T))"
  case $what in
    info) nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
          python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" ;;
    tests) timeout "${a:-300}" python3 -m pytest -q -m gpu tests/gpu/test_triton_gpu.py -x -p no:cacheprovider \
             >"$W/gpu_tests.log" 2>&1; echo "pytest rc=$?"; tail -15 "$W/gpu_tests.log" ;;
    bench) q=${a:-bf16}; p=${b:-$PRESETS}; t=${c:-$TOKENS}
           timeout "${BENCH_LIMIT:-420}" python3 -m moe bench --preset "$p" --quant "$q" --tokens "$t" \
             --json "$W/bench_${q//,/_}.json" --plot "$W/bench_${q//,/_}.png" \
             --save-profile "$W/profile_${q//,/_}.json" --machine "$MACHINE" \
             >"$W/bench_${q//,/_}.md" 2>"$W/bench_${q//,/_}.log"; echo "bench rc=$?"
           cat "$W/bench_${q//,/_}.md"; tail -3 "$W/bench_${q//,/_}.log" ;;
    tune) timeout "${TUNE_LIMIT:-400}" python3 -m moe tune --preset "$a" --quant "${b:-bf16}" --tokens "${c:-$TOKENS}" \
            --out "$W/configs" 2>"$W/tune_${a}_${b:-bf16}.log"; echo "tune rc=$?"
          grep -a "M=" "$W/tune_${a}_${b:-bf16}.log" | grep -av "\[" | tail -20; cp -r "$W/configs/." moe/experts/_triton/configs/ 2>/dev/null ;;
    pack) tar czf "$OUT/results.tgz" -C "$W" . && ls -la "$W" ;;
  esac
done
