#!/usr/bin/env bash
# "Why was Lightning slower?" on H200s: compare.py --explain with the
# tuned ZeRO profile, 1.5b preset, ZeRO-3 bf16, micro-batch 8.
# Usage on the device machine, from the repo root:  bash benchmarks/h200_explain.sh OUTDIR NGPUS FACTORS
set -uo pipefail
OUT=${1:?usage: h200_explain.sh OUTDIR NGPUS FACTORS}
NG=${2:?}
FACTORS=${3:?}
W="$OUT/explain_${NG}gpu"
mkdir -p "$W"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt"
timeout 570 python3 compare.py --explain --gpus "$NG" --preset 1.5b --stage 3 --precision bf16 --micro_batch 8 \
  --zero_profile tuned --fused_bias_dropout_add false --fused_bias_gelu false --steps 20 --warmup_steps 6 --repeats 2 --factor_repeats 2 --factors "$FACTORS" \
  --out "$W"; echo "rc=$?"
tar czf "$OUT/h200_explain_${NG}gpu.tar.gz" -C "$OUT" "explain_${NG}gpu" nvidia-smi.txt
