#!/bin/bash
# The measurements behind issue 14's scoreboard (benchmarks/issue14_scoreboard.py), on the device machine, step by
# step; each step's files go under $OUT/work and are packed into $OUT/results.tgz after it (a call returns few files).
#
#   export PYTHONPATH=; source .gpu/setup.sh && ROUNDS=3 bash benchmarks/issue14_run.sh bf16
#   ... && bash benchmarks/issue14_run.sh fp8 weight_only layer
#
# Steps (what session 36's scoreboard ran, in the same processes):
#   bf16         the four presets at M = 1-16384, ours and FlashInfer's CUTLASS MoE, one process per preset
#   fp8          fp8_block W8A8 on Qwen3-30B-A3B, GPT-OSS-120B and the DeepSeek-V3 EP8 slice, M = 1-16384
#   weight_only  GPT-OSS-120B MXFP4 and bf16 beside FlashInfer, GPT-OSS NVFP4, Qwen3 MXFP4 / NVFP4 / bf16, M <= 64
#   layer        benchmarks/layer_decode.py: router + experts + sum over k in one CUDA graph against the experts
# ROUNDS (default 1): `moe bench --rounds`, each cell's backends timed in turn and their median round kept.
# MACHINE: the kind the files record (default: nvidia-h200 or nvidia-h100, from nvidia-smi).
# Then, here: python benchmarks/issue14_scoreboard.py BENCH.json... --layer LAYER.json
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=$OUT/work
mkdir -p "$W"
case $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) in  # the kind recorded in the JSON files
  *H200*) MACHINE=${MACHINE:-nvidia-h200} ;;
  *H100*) MACHINE=${MACHINE:-nvidia-h100} ;;
  *) MACHINE=${MACHINE:-gpu} ;;
esac
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv,noheader
ROUNDS=${ROUNDS:-1}
DECODE=1,2,4,8,9,16,32,64

bench() {  # NAME LIMIT_S ARGS...: one moe bench process, its table on stdout, its log's tail
  local name=$1 limit=$2
  shift 2
  echo "--- $name ($(date +%T))"
  timeout "$limit" python3 -m moe bench "$@" --rounds "$ROUNDS" --machine "$MACHINE" --json "$W/$name.json" \
    >"$W/$name.md" 2>"$W/$name.log"
  echo "rc=$? ($(date +%T))"
  cat "$W/$name.md"
  tail -3 "$W/$name.log"
  tar czf "$OUT/results.tgz" -C "$W" .
}

for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    bf16)
      for preset in qwen3-30b-a3b mixtral-8x7b gpt-oss-120b deepseek-v3-ep8-slice; do
        bench "bf16_$preset" "${BF16_LIMIT:-200}" --preset "$preset" --quant bf16 \
          --tokens 1,16,256,1024,4096,16384 --experts triton,flashinfer_cutlass
      done ;;
    fp8)
      bench fp8_block "${FP8_LIMIT:-240}" --preset qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-ep8-slice \
        --quant fp8_block --tokens 1,16,1024,4096,16384 --experts triton ;;
    weight_only)
      bench gpt-oss_mxfp4_bf16 150 --preset gpt-oss-120b --quant mxfp4,bf16 --tokens $DECODE \
        --experts triton,flashinfer_cutlass
      bench gpt-oss_nvfp4 90 --preset gpt-oss-120b --quant nvfp4 --tokens $DECODE --experts triton
      bench qwen3_weight_only 150 --preset qwen3-30b-a3b --quant mxfp4,nvfp4,bf16 \
        --tokens 1,2,3,4,6,8,11,13,15,16,32,64 --experts triton ;;
    layer)
      echo "--- layer ($(date +%T))"
      timeout "${LAYER_LIMIT:-200}" python3 benchmarks/layer_decode.py --preset qwen3-30b-a3b,gpt-oss-120b \
        --quant bf16,mxfp4,nvfp4 --experts triton --tokens $DECODE --machine "$MACHINE" --json "$W/layer_decode.json" \
        >"$W/layer_decode.md" 2>"$W/layer_decode.log"
      echo "rc=$? ($(date +%T))"
      cat "$W/layer_decode.md"
      tail -3 "$W/layer_decode.log"
      tar czf "$OUT/results.tgz" -C "$W" . ;;
    *) echo "unknown step $step (bf16, fp8, weight_only, layer)"; exit 2 ;;
  esac
done
